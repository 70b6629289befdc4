"""Do cuBLASLt's other heuristic candidates run Qwen3-8B's projections faster than its first pick? (GPU)

`python benchmarks/cublaslt_probe.py [rows ...]`. PyTorch's matmul runs cuBLAS's default or cuBLASLt's first
heuristic pick, and its TunableOp registers no other kernel on CUDA (docs/perf_notes.md run 23). This asks
cuBLASLt itself (`heron.models.cublaslt`, the engine's binding) for its candidates per (shape, rows), checks each
one's product against F.linear, and times each by CUDA-graph replay over rotating weight copies (past the L2
cache), against cuBLAS's default and PyTorch's cuBLASLt (run 26; `heron/models/blas.py` now chooses among them
at start-up).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from heron.kernels.bench import _time_graph  # noqa: E402
from heron.models.blas import linear_lt  # noqa: E402
from heron.models.cublaslt import CublasLt  # noqa: E402

SHAPES = {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36), "down": (4096, 12288, 36),
          "lm_head": (151936, 4096, 1)}  # name: (N, K, per decode step)
ROWS = (32, 64, 128, 192, 200, 256)


def main(rows: tuple[int, ...]) -> None:
    dev = torch.device("cuda")
    lt = CublasLt(dev)
    print(torch.cuda.get_device_name(), torch.__version__, "cuBLASLt candidates per problem")
    step = {m: [0.0, 0.0, 0.0] for m in rows}  # cuBLAS default, PyTorch's cuBLASLt, best candidate
    for name, (n, k, count) in SHAPES.items():
        copies = max(1, min(8, (400 << 20) // (2 * n * k)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            t = [_time_graph(lambda: [call(x, w) for w in weights], iters=1) / copies for call in (F.linear, linear_lt)]
            cands = lt.candidates(m, n, k, torch.bfloat16, torch.bfloat16)
            timed = []
            for i, cand in enumerate(cands):
                try:
                    y.fill_(float("nan"))
                    lt.matmul(x, weights[0], y, cand)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:  # (NaN fails too)
                        print(f"    candidate {i}: wrong product (rel err {err:.3g}), skipped")
                        continue
                    t_cand = _time_graph(lambda: [lt.matmul(x, w, y, cand) for w in weights], iters=1)
                    timed.append((t_cand / copies, i, cand.workspace))
                except RuntimeError as e:
                    print(f"    candidate {i}: {e}")
            timed.sort()
            best = timed[0][0] if timed else float("inf")
            for j, v in enumerate((t[0], t[1], min(best, t[0], t[1]))):
                step[m][j] += count * v
            top = ", ".join(f"#{i} {s * 1e6:.1f} us (ws {ws >> 10} KiB)" for s, i, ws in timed[:3])
            print(f"{name:8s} M={m:5d}: cuBLAS {t[0] * 1e6:8.1f}  torch-Lt {t[1] * 1e6:8.1f}  "
                  f"{len(cands)} candidates, best x{min(t) / best:.3f} vs the better of the two: {top}")
    print("one decode step of Qwen3-8B's matmuls, ms: cuBLAS / PyTorch's cuBLASLt / best of all")
    for m, (a, b, c) in step.items():
        print(f"  M={m:5d}: {a * 1e3:7.2f} {b * 1e3:7.2f} {c * 1e3:7.2f}  x{min(a, b) / c:.3f}")


if __name__ == "__main__":
    main(tuple(int(r) for r in sys.argv[1:]) or ROWS)
