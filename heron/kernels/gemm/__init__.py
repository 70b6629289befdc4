"""The matmul door: every projection of a model runs through `linear.py` on CUDA, which picks the kernel.

- linear.py   the entry points the layers bind on CUDA: `linear(x, w, b)`, and the forms that take the op before
              the matmul into it at decode sizes (`rms_norm_linear`, `silu_mul_linear`); the GEMV (heron/kernels/
              gemv.py) at up to 16 rows, else blas.py.
- blas.py     cuBLAS, PyTorch's cuBLASLt or another cuBLASLt candidate, as the weight's tuned plan says; the LM
              head's float32-output matmul.
- fp8.py      FP8 (e4m3) W8A8: per-token activation quantization (fp8_quant.py's Triton kernel on CUDA) and
              `torch._scaled_mm` with row-wise scales; linear.py's entry points take a float8 weight with its
              `weight_scale` to it past 16 rows, to the GEMV's float8 variant up to 16 (docs/quantization.md).
- int4.py     int4 weight-only (W4A16): a Triton GEMM that dequantizes the packed weight in its K loop (split-K at
              decode sizes), which the int4 projection layers bind; its layout and tuning in the file's docstring.
- plans.py    `Plan` (one weight's choices by row count) and `MatmulPlans`, the registry a model runner owns;
              layers built inside `use_plans(registry)` keep it and pass it on each call.
- tune.py     the start-up tuner that fills the registry (`--matmul-tuning on`).
- cublaslt.py cuBLASLt through ctypes: its heuristic's candidates, a searched configuration from
              cublaslt_table.json (per GPU model; benchmarks/cublaslt_probe.py searches and writes it).

Only linear.py, fp8_quant.py and int4.py import Triton; the rest can be imported anywhere.
"""
