"""The W4A16 matmul (heron/kernels/gemm/int4.py) on Llama-3.1-8B's projections against bf16 cuBLAS, per row count (GPU).

`python benchmarks/int4_probe.py [rows ...]`. For each projection and row count: microseconds per call of the
int4 matmul (groups of 128 with zero points, AWQ's) and of bf16 F.linear, both by CUDA-graph replay over rotating
weight copies (past the L2 cache), and the int4 weight's read rate (packed weight + scales + zeros bytes / time)
as a fraction of the copy bandwidth: the number `_config`'s GEMV tiles and split-K are tuned against. Then the
sum over one decode step (32 layers). `--sweep` also times the one-row GEMV's tiles (BLOCK_N, BLOCK_K).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, ".")
from heron.bench.kernel_timing import time_graph  # noqa: E402
from heron.bench.roofline import copy_bandwidth  # noqa: E402
from heron.kernels.gemm import int4  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
LAYERS, GROUP = 32, 128
ROWS = (1, 4, 16, 32, 64, 256, 2048)


def _weights(n: int, k: int, copies: int, dev: torch.device) -> list[dict[str, torch.Tensor]]:
    return [
        dict(
            weight=torch.randint(-(2**31), 2**31, (n, k // 8), device=dev, dtype=torch.int64).to(torch.int32),
            weight_scale=torch.rand(n, k // GROUP, device=dev) * 0.01,
            weight_zero_point=torch.randint(0, 16, (n, k // GROUP), device=dev, dtype=torch.uint8),
        )
        for _ in range(copies)
    ]


def main(rows: tuple[int, ...], sweep: bool) -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(torch.cuda.get_device_name(), f"copy {bw / 1e9:,.0f} GB/s; us per call: int4 | bf16 | int4 read fraction")
    step = {m: [0.0, 0.0] for m in rows}
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(8, (400 << 20) // (n * k // 2)))
        qs = _weights(n, k, copies, dev)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(2, copies // 4))]
        nbytes = sum(t.numel() * t.element_size() for t in qs[0].values())
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t4 = time_graph(lambda: [int4.int4_linear(x, **q) for q in qs], iters=1) / len(qs)
            t16 = time_graph(lambda: [F.linear(x, w) for w in ws], iters=1) / len(ws)
            step[m][0] += LAYERS * t4
            step[m][1] += LAYERS * t16
            print(
                f"{name:8s} M={m:5d}  {t4 * 1e6:8.1f} | {t16 * 1e6:8.1f} | {nbytes / t4 / bw:.2f} ",
                int4._config(m, n, k, GROUP, dev),
            )
            if sweep and m == 1:
                _sweep(x, qs, n, k, m, nbytes, bw)
    for m, (t4, t16) in step.items():
        print(f"step (32 layers) M={m:5d}: int4 {t4 * 1e3:.3f} ms, bf16 {t16 * 1e3:.3f} ms, x{t16 / t4:.2f}")


def _sweep(x, qs, n, k, m, nbytes, bw) -> None:
    """The one-row GEMV's tiles, by patching `_config` (the one place the choices live); split-K as `_config`
    derives it from the tile count."""
    base = int4._config
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    sizes = [(4, 2048), (8, 1024), (8, 2048), (8, 4096), (16, 1024), (16, 2048)]
    for block_n, block_k in sizes:
        split = max(1, min(k // block_k, 2 * sms // triton.cdiv(n, block_n)))
        cfg = dict(base(m, n, k, GROUP, x.device), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split)
        int4._config = lambda *_, cfg=cfg: cfg
        try:
            t = time_graph(lambda: [int4.int4_linear(x, **q) for q in qs], iters=1) / len(qs)
            print(f"    {cfg}: {t * 1e6:8.1f} us, read fraction {nbytes / t / bw:.2f}")
        finally:
            int4._config = base


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--sweep"]
    main(tuple(int(a) for a in args) or ROWS, "--sweep" in sys.argv)
