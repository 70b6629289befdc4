"""The batch-1 kernels of one Qwen3-30B-A3B layer under Nsight Compute (GPU): the qkv GEMV with the input norm
in its prologue (5120 x 2048), the o GEMV (2048 x 4096), the router GEMV (128 x 2048) and the two MoE GEMV
kernels (`moe_gemv`: 8 of 128 experts, 768 x 2048 each), two launches of each after a warm-up. Run under ncu
(`gpu_check.sh ncu-moe`): DRAM throughput against the busiest pipe and the warps' stall reasons say whether a
kernel waits on memory it asked for too little of at once, or on its own work before the first load (the MoE
kernels route their token first), which is what issue 22's batch-1 gap to the roofline comes down to.

    ncu --clock-control none --kernel-name regex:"gemv|_up_kernel|_down_kernel" ... python benchmarks/ncu_moe.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from heron.kernels.gemv import gemv, gemv_rms_norm  # noqa: E402
from heron.kernels.moe_gemv import moe_gemv  # noqa: E402

HIDDEN, HEADS_OUT, EXPERTS, TOP_K, INTER = 2048, 4096, 128, 8, 768


def main() -> None:
    dev = torch.device("cuda")
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02  # noqa: E731
    x, residual, norm_w = mk(1, HIDDEN), mk(1, HIDDEN), torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    w_qkv, w_o, w_router = mk(HEADS_OUT + 1024, HIDDEN), mk(HIDDEN, HEADS_OUT), mk(EXPERTS, HIDDEN)
    w13, w2 = mk(EXPERTS, 2 * INTER, HIDDEN), mk(EXPERTS, HIDDEN, INTER)
    attn = mk(1, HEADS_OUT)
    logits = gemv(x, w_router)
    for label, call in (
        ("qkv (norm prologue)", lambda: gemv_rms_norm(x, residual, norm_w, 1e-6, w_qkv)),
        ("o", lambda: gemv(attn, w_o)),
        ("router", lambda: gemv(x, w_router)),
        ("experts (up, down)", lambda: moe_gemv(x, logits, w13, w2, TOP_K, True)),
    ):
        call()
        torch.cuda.synchronize()
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        print(f"{label}: launched", flush=True)


if __name__ == "__main__":
    main()
