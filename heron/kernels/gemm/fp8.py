"""FP8 (e4m3) W8A8 matmuls: the weight stored in float8 with a float32 scale per output channel, the activations
quantized per token (row) at each call.

Why per token and per channel: both scales then factor out of the dot product, y[m, n] = sx[m] * sw[n] *
sum_k xq[m, k] wq[n, k], which is what `torch._scaled_mm`'s row-wise scaling computes in one cuBLASLt FP8 GEMM
(twice bf16's tensor-core rate on Hopper, half its weight bytes at decode). A checkpoint's per-tensor scale is
stored as the same scale on every row, so one kernel serves both. Dynamic activation scales need no calibration
and follow outliers token by token; a checkpoint's static `input_scale` is not used.

On CUDA the quantization is one Triton kernel (fp8_quant.py), elsewhere its PyTorch reference; the GEMM is
`torch._scaled_mm`, which also runs on the CPU (the tests compare it with `fp8_linear_ref`). At decode sizes
the matmul door (linear.py) takes a float8 weight to the GEMV instead, which reads it at full bandwidth with x
left in 16 bits (W8A16).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row keeps a finite, nonzero scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq float8 [..., K], scale float32 [..., 1]) with x ~= xq * scale: each row's absolute max maps to 448."""
    if x.is_cuda:
        from heron.kernels.gemm.fp8_quant import quantize_fp8_rows_triton

        return quantize_fp8_rows_triton(x, FP8_DTYPE, FP8_MAX, MIN_SCALE)
    return quantize_fp8_rows_ref(x)


def quantize_fp8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_rows` in PyTorch ops."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor
) -> torch.Tensor:
    """F.linear(x, weight * weight_scale, bias) with x quantized per token: `torch._scaled_mm` with row-wise
    scales. weight float8 [N, K] (row-major, so `.t()` is the column-major operand cuBLASLt wants), weight_scale
    float32 [N, 1]; the output in x's dtype. On CUDA, K and N must be multiples of 16 (every model's are)."""
    shape = x.shape
    xq, x_scale = quantize_fp8_rows(x.reshape(-1, shape[-1]))
    # cuBLASLt's row-wise scaling writes bfloat16 only
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=out_dtype)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])
