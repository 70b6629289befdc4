"""How much faster can Qwen3-8B's projections run in the BLAS libraries than in their default picks? (GPU)

`python benchmarks/blas_probe.py [rows ...]`. For each projection shape and row count: cuBLAS (PyTorch's
default), cuBLASLt's first heuristic pick, and PyTorch's TunableOp (which times cuBLAS's default against up
to eight of cuBLASLt's heuristic candidates and keeps the fastest), each timed by CUDA-graph replay over
rotating weight copies (past the L2 cache), then the sum over one decode step (36 layers + the LM head).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from heron.bench.kernel_timing import time_graph  # noqa: E402
from heron.kernels.gemm.blas import linear_lt  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096, 36),
    "o": (4096, 4096, 36),
    "gate_up": (24576, 4096, 36),
    "down": (4096, 12288, 36),
    "lm_head": (151936, 4096, 1),
}  # name: (N, K, per step)
ROWS = (32, 64, 96, 128, 160, 192, 200, 224, 256, 8192)


def main(rows: tuple[int, ...]) -> None:
    tunable = torch.cuda.tunable
    tunable.set_filename("/tmp/tunableop_results.csv")  # written at exit
    tunable.set_max_tuning_iterations(30)
    tunable.set_rotating_buffer_size(256)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, "cuBLAS / cuBLASLt / TunableOp, us per call")
    step = {m: [0.0, 0.0, 0.0] for m in rows}
    for name, (n, k, count) in SHAPES.items():
        copies = max(1, min(8, (400 << 20) // (2 * n * k)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ws = weights if m <= 512 else weights[:2]

            def run(ws=ws, x=x):
                for w in ws:
                    F.linear(x, w)

            t = [time_graph(lambda: [call(x, w) for w in ws], iters=1) / len(ws) for call in (F.linear, linear_lt)]
            tunable.enable(True)
            tunable.tuning_enable(True)
            ref = F.linear(x, ws[0])  # tunes this shape
            tunable.tuning_enable(False)
            t.append(time_graph(run, iters=1) / len(ws))
            diff = (F.linear(x, ws[0]).float() - ref.float()).abs().max().item()
            tunable.enable(False)
            base = F.linear(x, ws[0]).float()
            err = (ref.float() - base).abs().max().item()
            for i in range(3):
                step[m][i] += count * t[i]
            print(
                f"{name:8s} M={m:5d}: {t[0] * 1e6:8.1f} {t[1] * 1e6:8.1f} {t[2] * 1e6:8.1f}  "
                f"x{t[0] / t[2]:.3f}  (tuned vs default max|diff| {err:.3g}, repeat {diff:.3g})"
            )
        del weights
    picks = tunable.get_results()
    print("TunableOp picks:", len(picks))
    for p in picks:
        print("  ", p)
    print("one decode step of Qwen3-8B's matmuls, ms: cuBLAS / cuBLASLt / TunableOp")
    for m, (a, b, c) in step.items():
        print(f"  M={m:5d}: {a * 1e3:7.2f} {b * 1e3:7.2f} {c * 1e3:7.2f}  x{a / c:.3f}")
    n, k, _ = SHAPES["lm_head"]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    print("LM head to float32 logits, us: F.linear + .float() / torch.mm(out_dtype=float32)")
    for m in (64, 200, 256):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.float32)
        a = time_graph(lambda: out.copy_(F.linear(x, w)), iters=1)
        b = time_graph(lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out), iters=1)
        diff = (torch.mm(x, w.t(), out_dtype=torch.float32) - F.linear(x.float(), w.float())).abs().max().item()
        print(f"  M={m}: {a * 1e6:7.1f} {b * 1e6:7.1f}  (float32 out vs float32 reference max|diff| {diff:.3g})")


if __name__ == "__main__":
    main(tuple(int(r) for r in sys.argv[1:]) or ROWS)
