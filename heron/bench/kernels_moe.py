"""The fused MoE kernels (GPU) on Qwen3-30B-A3B's experts (128 SwiGLU experts of 2048 -> 768 -> 2048, 8 a token):
`python -m heron.bench.kernels --moe [--sweep] [--rows 1,4,16,...]`. Per token count, the routed experts of one
layer from the router's logits (heron.kernels.fused_moe's `fused_moe`: the decode GEMVs at a few tokens, else
routing, alignment, both grouped GEMMs and the combine) by CUDA-graph replay over several layers' weights (so
the experts a call touches come from HBM, as in a step), with TB/s over the bytes of those experts and TFLOP/s;
where the GEMVs serve, the grouped GEMMs are timed beside them. --sweep times `_moe_candidates` (the grouped
GEMM) and prints the winners as fused_moe.CONFIGS lines."""

from __future__ import annotations

import itertools
import time

import torch

from heron.bench.kernel_timing import time_graph

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
MOE_ROWS = (1, 4, 16, 64, 256, 1024, 8192)  # decode batches and prefill steps (the keys of fused_moe.CONFIGS)
LAYERS = 4  # weight copies rotated through: 4 x 38 MB of experts at batch 1, past the 50 MB L2 cache


def _moe_candidates(tokens: int) -> list:
    """Tiles x warps x stages; BLOCK_M from 16 up to the one that holds a typical expert's entries whole."""
    from heron.kernels.fused_moe import MoeGemmConfig

    per_expert = tokens * TOP_K / EXPERTS
    block_ms = [bm for bm in (16, 32, 64, 128) if bm == 16 or bm <= 2 * per_expert]
    return [
        MoeGemmConfig(bm, bn, bk, group_m=1 if bm == 16 else 8, num_warps=w, num_stages=st)
        for bm, bn, bk in itertools.product(block_ms, (32, 64, 128), (64, 128))
        for w in (4, 8)
        for st in (3, 4)
        if st * (bm + 2 * bn) * bk * 2 <= 200 << 10  # shared memory: A and the gate and up tiles per stage
    ]


def _sweep_gemvs(run, timed) -> None:
    """The decode GEMVs' configs: the first kernel's candidates with the second's default, then the second's
    with the first's best; prints the best three of each."""
    from heron.kernels.moe_gemv import GemvMoeConfig, default_config

    candidates = [
        GemvMoeConfig(bn, bk, num_warps=w, num_stages=st)
        for bn, bk, w, st in itertools.product((4, 8, 16), (256, 512), (2, 4, 8), (3, 4))
    ]
    best = [default_config(INTER, HIDDEN, 2), default_config(HIDDEN, INTER, 2)]
    for which in (0, 1):
        results = []
        for cfg in candidates:
            cfgs = tuple(cfg if i == which else best[i] for i in (0, 1))
            try:
                results.append((timed(lambda w13, w2, cfgs=cfgs: run(cfgs, w13, w2), cfgs), cfg))
            except AssertionError:
                raise
            except Exception:  # noqa: BLE001 - a config that does not compile or launch is skipped
                pass
        results.sort(key=lambda r: r[0])
        best[which] = results[0][1]
        for t, cfg in results[:3]:
            print(f"    {'up' if which == 0 else 'down'} kernel: {t * 1e6:7.1f} us (both kernels) with {cfg}")


def bench_moe(sweep: bool = False, rows: tuple[int, ...] = MOE_ROWS) -> None:
    from heron.kernels.fused_moe import GEMV_MAX_TOKENS, fused_experts, fused_moe, per_entry, pick_config
    from heron.kernels.moe_gemv import moe_gemv
    from heron.kernels.moe_routing import topk_softmax
    from heron.kernels.reference import fused_experts_ref

    dev, start, best = torch.device("cuda"), time.perf_counter(), {}
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = [
        (
            torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) * HIDDEN**-0.5,
            torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=torch.bfloat16, generator=gen) * INTER**-0.5,
        )
        for _ in range(LAYERS)
    ]
    print(
        f"fused MoE: {torch.cuda.get_device_name(dev)}, bf16, {EXPERTS} experts of {HIDDEN} -> {INTER}, {TOP_K} a token"
    )
    for m in rows:
        x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(m, EXPERTS, device=dev, dtype=torch.bfloat16, generator=gen)
        weights, ids = topk_softmax(logits, TOP_K, renormalize=True)
        touched = ids.unique().numel()
        nbytes, flops = touched * 3 * HIDDEN * INTER * 2, 2 * 3 * HIDDEN * INTER * m * TOP_K
        ref = fused_experts_ref(x, *layers[0], weights, ids).float()

        def _timed(run, what) -> float:
            err = (run(*layers[0]).float() - ref).norm() / ref.norm()
            assert err < 1e-2, f"the MoE kernels disagree with the reference: relative error {err:.3g} ({what})"
            it = itertools.cycle(layers)
            return time_graph(lambda: run(*next(it)), iters=4 * LAYERS)

        def timed(cfg=None) -> float:
            """The grouped GEMMs with `cfg`, routing included."""

            def run(w13, w2):
                return fused_experts(x, w13, w2, *topk_softmax(logits, TOP_K, True), config=cfg)

            return _timed(run, cfg)

        def show(label: str, t: float) -> None:
            print(
                f"  T={m:<5d} {t * 1e6:9.1f} us {nbytes / t / 1e12:5.2f} TB/s over {touched} experts "
                f"{flops / t / 1e12:6.1f} TFLOP/s  {label}"
            )

        t_door = _timed(lambda w13, w2: fused_moe(x, logits, w13, w2, TOP_K, True), "fused_moe")
        if per_entry(m, EXPERTS, TOP_K):  # few enough tokens for the GEMVs: both paths, whichever the door takes

            def gemv_run(w13, w2):
                return moe_gemv(x, logits, w13, w2, TOP_K, True)

            show("the decode GEMVs (moe_gemv)", _timed(gemv_run, "moe_gemv"))
            t = timed()
            show(f"grouped GEMMs {pick_config(m, EXPERTS, INTER, HIDDEN, TOP_K, x.dtype)}", t)
            print(
                f"    fused_moe takes the {'GEMVs' if m <= GEMV_MAX_TOKENS else 'grouped GEMMs'}: {t_door * 1e6:.1f} us"
            )
            if sweep:
                _sweep_gemvs(lambda cfgs, w13, w2: moe_gemv(x, logits, w13, w2, TOP_K, True, configs=cfgs), _timed)
        else:
            t = t_door
            show(f"fused_moe {pick_config(m, EXPERTS, INTER, HIDDEN, TOP_K, x.dtype)}", t)
        if sweep:
            results, failed = [], 0
            for cfg in _moe_candidates(m):
                try:
                    results.append((timed(cfg), cfg))
                except AssertionError:  # a wrong result is a bug of the kernel, not a config to skip
                    raise
                except Exception:  # noqa: BLE001 - a config that does not compile or launch (shared memory) is skipped
                    failed += 1
            results.sort(key=lambda r: r[0])
            print(f"    sweep: {len(results)} configs ({failed} failed)")
            for t_cfg, cfg in results[:3]:
                print(
                    f"      {t_cfg * 1e6:9.1f} us {nbytes / t_cfg / 1e12:5.2f} TB/s x{t / t_cfg:4.2f} vs default {cfg}"
                )
            if results:
                best[m] = (*results[0], t)
    if sweep:
        print("swept configs beating the default by > 3% (for fused_moe.CONFIGS, or a better default_config):")
        for m, (t, cfg, t_def) in sorted(best.items()):
            if t < 0.97 * t_def:
                key = (m, EXPERTS, INTER, HIDDEN, TOP_K)
                print(f"  CONFIGS[{key}] = {cfg!r}  # {t * 1e6:.1f} us, default {t_def * 1e6:.1f} us")
    print(f"fused MoE bench: {time.perf_counter() - start:.0f} s")
