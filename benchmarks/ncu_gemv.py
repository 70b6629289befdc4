"""The batch-1 matmuls of Llama-3.1-8B's MLP under Nsight Compute (GPU): the int4 GEMV (AWQ groups of 128 with
zeros), the float8 GEMV (a scale per row) and the bf16 GEMV, each on gate_up (28672 x 4096) and down (4096 x
14336), two launches of each after a warm-up. Run under ncu (`gpu_check.sh ncu-gemv`): its Speed Of Light and
compute-pipe sections say what bounds each kernel (DRAM throughput against the SM's busiest pipe), which is
what explains a format's batch-1 gap to its weights' roofline (issue 24).

    ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight ... python benchmarks/ncu_gemv.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from heron.kernels.gemm import int4  # noqa: E402
from heron.kernels.gemm.fp8 import quantize_fp8_rows  # noqa: E402
from heron.kernels.gemv import gemv  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GROUP = 128


def main() -> None:
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q = dict(
            weight=torch.randint(-(2**31), 2**31, (n, k // 8), device=dev, dtype=torch.int64).to(torch.int32),
            weight_scale=torch.rand(n, k // GROUP, device=dev) * 0.01,
            weight_zero_point=torch.randint(0, 16, (n, k // GROUP), device=dev, dtype=torch.uint8),
        )
        w8, s8 = quantize_fp8_rows(w)
        for label, call in (
            ("int4", lambda: int4.int4_linear(x, **q)),
            ("fp8", lambda: gemv(x, w8, weight_scale=s8)),
            ("bf16", lambda: gemv(x, w)),
        ):
            call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name} {label}")
            for _ in range(2):
                call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(f"{name} {label}: launched", flush=True)


if __name__ == "__main__":
    main()
