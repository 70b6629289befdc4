"""The gathered LoRA kernels at Qwen3-8B's four projections (rank 16 on every part, 8 adapters round robin), timed
under CUDA-graph replay for each configuration of a sweep around heron/kernels/lora.py's SHRINK and EXPAND: the
shrink and the expand at 256 tokens (the offline workload's decode step, where a profile put them at 4.9% and 7.7%
of the step) and at 8,192 (its prefill step), and the shrink at 1 token with its prologues (a float8 weight's
batch-1 projection; a 16-bit weight's GEMV runs the A rows in its own grid, heron/kernels/gemv.py). Per
configuration, one layer's sum over the projections (the door's configuration is one for all of them), and each
result against the default configuration's.

    python benchmarks/lora_probe.py        (the sweeps)
    python benchmarks/lora_probe.py act    (gate/up's expand inside the activation against apart)
    python benchmarks/lora_probe.py row    (batch 1: each projection's GEMV alone, with its adapter, without)
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

from heron.executor.lora_manager import group_by_slot
from heron.kernels.lora import EXPAND, SHRINK, LoRARows, lora_shrink, part_offsets

HIDDEN, INTER, RANK, SLOTS = 4096, 12288, 16, 8
# name: (in, output parts, the shrink's prologue at one token: what the engine's door runs there)
PROJECTIONS = {
    "qkv": (HIDDEN, [4096, 1024, 1024], "norm"),
    "o": (HIDDEN, [HIDDEN], None),
    "gate_up": (HIDDEN, [INTER, INTER], "norm_residual"),
    "down": (INTER, [HIDDEN], "silu"),
}
EXPAND_GRID = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w) for m, n, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))
]
SHRINK_GRID = [
    dict(BLOCK_M=m, BLOCK_K=k, num_stages=s) for m, k, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 3))
]
SWEEPS = {  # (tokens, the kernel, the configurations: each a dict of overrides)
    "expand @256": (256, "expand", EXPAND_GRID),
    "shrink @256": (256, "shrink", SHRINK_GRID),
    "shrink @1": (
        1,
        "shrink",
        [dict(BLOCK_K=k, num_warps=w) for k, w in itertools.product((64, 128, 256, 512), (1, 2, 4))],
    ),
    # a prefill step's (the offline workload's 8,192-token steps took 228 ms with the adapters, H100 profile)
    "expand @8192": (8192, "expand", EXPAND_GRID),
    "shrink @8192": (8192, "shrink", SHRINK_GRID),
}


def projection(name: str, tokens: int, dev: torch.device) -> dict:
    """One projection's adapters, mapping and inputs, as the engine hands them to the kernels."""
    in_size, parts, prologue = PROJECTIONS[name]
    gen = torch.Generator().manual_seed(len(name))
    r2, n = len(parts) * RANK, sum(parts)
    a = (torch.randn(SLOTS, r2, in_size, generator=gen) / in_size**0.5).to(dev, torch.bfloat16)
    b = torch.zeros(SLOTS, r2, n)
    for p, size in enumerate(parts):  # block-diagonal over the parts
        col = sum(parts[:p])
        b[:, p * RANK : (p + 1) * RANK, col : col + size] = torch.randn(SLOTS, RANK, size, generator=gen) * 0.02
    slots = np.arange(tokens) % SLOTS
    order, starts = group_by_slot(slots, SLOTS)
    order = np.concatenate([order, np.zeros(64, dtype=order.dtype)])  # the engine's buffer is longer than a step
    kwargs = {}
    x = torch.randn(tokens, in_size, generator=gen)
    if tokens == 1 and prologue == "silu":
        x = torch.randn(tokens, 2 * in_size, generator=gen)
        kwargs["act"] = "silu"
    elif tokens == 1 and prologue:
        kwargs["norm"] = ((torch.rand(in_size, generator=gen) + 0.5).to(dev, torch.bfloat16), 1e-6)
        if prologue == "norm_residual":
            kwargs["residual"] = torch.randn(tokens, in_size, generator=gen).to(dev, torch.bfloat16)
    return dict(
        x=x.to(dev, torch.bfloat16),
        y=torch.zeros(tokens, n, device=dev, dtype=torch.bfloat16),
        weights=(
            a,
            b.to(dev, torch.bfloat16),
            torch.from_numpy(slots).to(dev),
            torch.from_numpy(order).to(dev),
            torch.from_numpy(starts).to(dev),
            parts,
            RANK,
        ),
        kwargs=kwargs,
    )


def timed(p: dict, kernel: str, cfg: dict) -> tuple[float, torch.Tensor]:
    """us per call of the kernel under `cfg`, and its result (the delta added to zeros)."""
    delta = lambda c=None: lora_shrink(p["x"], *p["weights"], config=c, **p["kwargs"])  # noqa: E731
    if kernel == "shrink":
        fn = lambda: delta(cfg)  # noqa: E731
        out = delta(cfg).add_to_(torch.zeros_like(p["y"]))
    else:
        d = delta()
        fn = lambda: d.add_to_(p["y"], cfg)  # noqa: E731
        out = d.add_to_(torch.zeros_like(p["y"]), cfg)
    return do_bench_cudagraph(fn, rep=50) * 1e3, out


def main() -> None:
    dev = torch.device("cuda")
    print(f"defaults: SHRINK {SHRINK}, EXPAND {EXPAND}")
    for label, (tokens, kernel, configs) in SWEEPS.items():
        inputs = {name: projection(name, tokens, dev) for name in PROJECTIONS}
        base = {name: timed(p, kernel, {}) for name, p in inputs.items()}
        total = sum(t for t, _ in base.values())
        per = ", ".join(f"{name} {t:.1f}" for name, (t, _) in base.items())
        print(f"== {label}: default {total:.1f} us a layer ({per})")
        rows = []
        for cfg in configs:
            try:
                res = {name: timed(p, kernel, cfg) for name, p in inputs.items()}
            except Exception as e:  # noqa: BLE001 (a configuration that does not compile or fit: say so, go on)
                print(f"  {cfg}: {type(e).__name__}")
                continue
            err = max(
                ((o.float() - base[n][1].float()).norm() / base[n][1].float().norm()).item()
                for n, (_, o) in res.items()
            )
            rows.append((sum(t for t, _ in res.values()), cfg, res, err))
        for layer, cfg, res, err in sorted(rows, key=lambda r: r[0]):
            per = ", ".join(f"{name} {t:.1f}" for name, (t, _) in res.items())
            print(f"  {layer:7.1f} us a layer ({total / layer:.2f}x default): {cfg} ({per}; max rel diff {err:.1e})")


def fused_act() -> None:
    """gate/up's delta past 16 rows: the expand into y then the activation kernel, against the two in one kernel
    (`LoRADelta.act_and_mul`), at 256 and 8,192 tokens (us a layer)."""
    from heron.kernels.activation import silu_and_mul

    dev = torch.device("cuda")
    for tokens in (256, 8192):
        p = projection("gate_up", tokens, dev)
        d = lora_shrink(p["x"], *p["weights"])
        y = p["y"]
        apart = do_bench_cudagraph(lambda: silu_and_mul(d.add_to_(y)), rep=50) * 1e3  # noqa: B023
        fused = do_bench_cudagraph(lambda: d.act_and_mul(y, False), rep=50) * 1e3  # noqa: B023
        y.zero_()
        err = (d.act_and_mul(y, False).float() - silu_and_mul(d.add_to_(y.clone())).float()).abs().max().item()
        print(f"gate/up at {tokens} tokens: expand + activation {apart:.1f} us, in one kernel {fused:.1f} us "
              f"({apart / fused:.2f}x), max abs diff {err:.1e}")  # fmt: skip


def one_row() -> None:
    """Batch-1 decode with one adapter (issue 25: <= 15% over the base) spends its overhead in these calls: each
    projection's GEMV as the engine's door runs it at one row (its prologue), under CUDA-graph replay, (1) alone,
    (2) with the adapter's A rows in its grid (`LoRARows`, the engine's path), (3) the same for a row without an
    adapter (slot -1: the path's fixed cost), (4) after a separate shrink launch (`LoRADelta` in its epilogue,
    the path before), in us and as the sum over a layer's four projections."""
    from heron.kernels.gemv import gemv, gemv_rms_norm, gemv_silu_mul

    dev = torch.device("cuda")
    totals = np.zeros(4)
    for name, (in_size, parts, prologue) in PROJECTIONS.items():
        p = projection(name, 1, dev)
        a, b, slots, _, _, sizes, rank = p["weights"]
        w = (torch.randn(sum(parts), in_size, device=dev) / in_size**0.5).to(torch.bfloat16)
        x, kw = p["x"], p["kwargs"]

        def run(lora):
            if prologue == "silu":
                return gemv_silu_mul(x, w, lora=lora)
            if prologue:
                norm_w, eps = kw["norm"]
                return gemv_rms_norm(x, kw.get("residual"), norm_w, eps, w, lora=lora)[0]
            return gemv(x, w, lora=lora)

        def rows(s: torch.Tensor) -> LoRARows:
            return LoRARows(a, b, s, part_offsets(sizes, w.shape[0]), rank, lambda: None)

        none = torch.full_like(slots, -1)
        cases = [
            lambda: run(None),
            lambda: run(rows(slots)),
            lambda: run(rows(none)),
            lambda: run(lora_shrink(x, *p["weights"], **kw)),
        ]
        us = np.array([do_bench_cudagraph(fn, rep=50) * 1e3 for fn in cases])
        ref = cases[3]().float()
        err = ((cases[1]().float() - ref).norm() / ref.norm()).item()
        totals += us
        print(f"{name}: alone {us[0]:.1f} us, A rows in its grid {us[1]:.1f} (+{us[1] - us[0]:.1f}), no adapter "
              f"{us[2]:.1f}, after a shrink launch {us[3]:.1f} (+{us[3] - us[0]:.1f}); A rows against the shrink "
              f"launch: {err:.1e} relative")  # fmt: skip
    print(f"a layer: alone {totals[0]:.1f} us, A rows {totals[1]:.1f}, no adapter {totals[2]:.1f}, "
          f"shrink launch {totals[3]:.1f}")  # fmt: skip


if __name__ == "__main__":
    import sys

    {"act": fused_act, "row": one_row}.get(sys.argv[1] if sys.argv[1:] else "", main)()
