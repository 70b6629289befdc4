"""The decode weight GEMMs (GPU): heron.kernels.gemv against cuBLAS (and PyTorch's cuBLASLt past 16 rows) on the
projections of Qwen3-0.6B, Llama-3.1-8B, Qwen3-8B and Qwen3-30B-A3B's attention and router; `python -m
heron.bench.kernels --gemv [--sweep]`, the sweep searching gemv's configs per shape (its CONFIGS table comes from
there)."""

from __future__ import annotations

import itertools
import time

import torch

from heron.bench.kernel_timing import time_graph

# Decode weight GEMMs: model -> (decoder layers, [(name, N, K)] of one layer, the LM head's (name, N, K)).
GEMV_MODELS = {
    "Qwen3-0.6B": (
        28,
        [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
        ("lm_head", 151936, 1024),
    ),
    "Llama-3.1-8B": (
        32,
        [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
        ("lm_head", 128256, 4096),
    ),
    "Qwen3-8B": (
        36,
        [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
        ("lm_head", 151936, 4096),
    ),
    "Qwen3-30B-A3B": (  # its dense GEMVs at batch 1 (the experts are heron.kernels.moe_gemv's: `--moe`)
        48,
        [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048)],
        ("lm_head", 151936, 2048),
    ),
}


GEMV_ROWS = (1, 8, 16, 32, 64, 128, 192, 200, 256)  # > 16: cuBLAS only (the offline run's decode batches)


def _weight_copies(n: int, k: int, dev: torch.device) -> list[torch.Tensor]:
    """Copies of an [N, K] bf16 weight, >= 256 MiB in all: a decode step reads every weight once from HBM, and
    replaying one small matrix would read it from the 50 MB L2 instead."""
    copies = max(1, min(64, -(-(256 << 20) // (2 * n * k))))
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16).mul_(k**-0.5) for _ in range(copies)]


def _time_rotating(call, weights: list) -> float:
    """Seconds per call(w) in a CUDA graph cycling through the weight copies (>= 512 MiB of weights per replay);
    a copy is a tensor or a (float8 weight, scales) pair."""
    w = weights[0][0] if isinstance(weights[0], tuple) else weights[0]
    nbytes = w.numel() * w.element_size()
    it = itertools.cycle(weights)
    return time_graph(lambda: call(next(it)), iters=max(len(weights), 3, -(-(512 << 20) // nbytes)))


def _gemv_candidates(m: int, n: int, k: int, sms: int) -> list:
    """The sweep's grid for one shape: tiles x warps x stages, each with the split counts from the first giving
    >= 1/2 program per SM to the first giving >= 2 (at most 16, at most one split per K-tile). M == 1 adds the
    FMA path; the tensor-core tiles are shared by every M (one binary), so M < 16 reuses M = 16's best."""
    from heron.kernels.gemv import GemvConfig

    def splits(bn: int, bk: int) -> list[int]:
        tiles, k_tiles = -(-n // bn), -(-k // bk)
        ok = [s for s in (1, 2, 4, 8, 16) if s <= k_tiles]
        lo = next((s for s in ok if 2 * tiles * s >= sms), ok[-1])
        hi = next((s for s in ok if tiles * s >= 2 * sms), ok[-1])
        return [s for s in ok if lo <= s <= hi]

    tiles = (
        [(bn, bk, True) for bn in (32, 64, 128) for bk in (128, 256)]
        if m > 1
        else [(bn, bk, False) for bn, bk in ((8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))]
    )
    return [
        GemvConfig(bn, bk, s, w, st, dot)
        for bn, bk, dot in tiles
        if bk <= k
        for w in (4, 8)
        for st in (2, 3, 4)
        if not dot or st * (bn + 16) * bk * 2 <= 200 << 10
        for s in splits(bn, bk)
    ]


def _fp8_candidates(m: int, n: int, k: int, sms: int) -> list:
    """`_gemv_candidates` unsplit, each tile's K doubled: a float8 weight's row of a tile holds twice the columns
    of a 16-bit one's in the same bytes (`default_config` picks its tiles by bytes too)."""
    from dataclasses import replace

    return [replace(c, block_k=2 * c.block_k, split_k=1) for c in _gemv_candidates(m, n, 2 * k, sms) if c.split_k == 1]


def bench_gemv_fp8(sweep: bool = False, only: str | None = None) -> None:
    """The float8 GEMV (W8A16, a scale per row: FP8 checkpoints and `--quantization fp8`) against the bf16 GEMV on
    the same per-layer shapes at 1, 8 and 16 rows, by CUDA-graph replay over rotating weight copies (TB/s counts
    each one's weight bytes), and per model the sum over one decode step's layers. `sweep`: search tiles sized
    for one-byte weights at 1 and 16 rows and print those beating the default by > 3%."""
    from heron.kernels.gemm.fp8 import quantize_fp8_rows
    from heron.kernels.gemv import gemv, pick_config

    dev, start, found = torch.device("cuda"), time.perf_counter(), []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"gemv fp8: {torch.cuda.get_device_name(dev)}, float8 e4m3 weights with row scales vs bf16")
    for model, (layers, per_layer, _) in GEMV_MODELS.items():
        if only and only.lower() not in model.lower():
            continue
        step = {m: [0.0, 0.0] for m in (1, 8, 16)}  # bf16 s, fp8 s per decode step's layers
        for name, n, k in per_layer:
            bf16 = _weight_copies(n, k, dev)
            fp8 = [quantize_fp8_rows(w) for w in bf16]
            print(f"{model} {name} N={n} K={k} ({n * k / 1e6:.1f} MB in float8, x{layers} per step)")
            for m in (1, 8, 16):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t16 = _time_rotating(lambda w: gemv(x, w), bf16)
                t8 = _time_rotating(lambda ws: gemv(x, ws[0], weight_scale=ws[1]), fp8)
                step[m][0] += layers * t16
                step[m][1] += layers * t8
                print(
                    f"  M={m:<3d} bf16 {t16 * 1e6:7.1f} us {2 * n * k / t16 / 1e12:5.2f} TB/s | fp8 {t8 * 1e6:7.1f} us "
                    f"{n * k / t8 / 1e12:5.2f} TB/s x{t16 / t8:4.2f} {pick_config(m, n, k, fp8[0][0].dtype, dev)}"
                )
                if not sweep or m == 8:
                    continue
                timed = []
                for cfg in _fp8_candidates(m, n, k, sms):
                    try:
                        timed.append(
                            (_time_rotating(lambda ws, c=cfg: gemv(x, ws[0], weight_scale=ws[1], config=c), fp8), cfg)
                        )
                    except Exception:  # noqa: BLE001 - a config that does not compile or launch is skipped
                        continue
                timed.sort(key=lambda r: r[0])
                for t, cfg in timed[:3]:
                    print(f"    sweep M={m}: {t * 1e6:7.1f} us {n * k / t / 1e12:5.2f} TB/s x{t8 / t:4.2f} {cfg}")
                if timed and timed[0][0] < 0.97 * t8:
                    found.append(((1 if m == 1 else 16, n, k), timed[0][1], timed[0][0], t8))
            del bf16, fp8
        for m, (t16, t8) in step.items():
            print(f"{model} M={m}: the layers' GEMVs bf16 {t16 * 1e6:8.1f} us, fp8 {t8 * 1e6:8.1f} us x{t16 / t8:4.2f}")
    for key, cfg, t, t_def in found:
        print(f"  fp8 (rows, N, K) {key}: {cfg!r}  # {t * 1e6:.1f} us, default {t_def * 1e6:.1f} us")
    print(f"gemv fp8 bench: {time.perf_counter() - start:.0f} s")


def _gemv_sweep(n: int, k: int, xs: dict, weights: list[torch.Tensor], default: dict, best: dict) -> None:
    """Times the candidate configs of one shape at M = 16, then 8 and 1 (M = 16's six best tensor-core configs,
    plus the FMA grid for M = 1); prints the three best per M and records (time, config, default's time) in
    `best[(m, n, k)]`."""
    from heron.kernels.gemv import gemv

    sms = torch.cuda.get_device_properties(weights[0].device).multi_processor_count
    nbytes, top_dot = 2 * n * k, []
    for m in (16, 8, 1):
        x = xs[m]
        cands = (_gemv_candidates(16, n, k, sms) if m == 16 else top_dot[:6]) + (
            _gemv_candidates(1, n, k, sms) if m == 1 else []
        )
        results, failed = [], 0
        for cfg in cands:
            try:
                results.append((_time_rotating(lambda w, cfg=cfg: gemv(x, w, config=cfg), weights), cfg))
            except Exception:  # noqa: BLE001 - a config that does not compile or launch (shared memory) is skipped
                failed += 1
        results.sort(key=lambda r: r[0])
        if m == 16:
            top_dot = [c for _, c in results]
        t_def = default[m]
        print(f"    sweep M={m}: {len(results)} configs ({failed} failed); default {t_def * 1e6:.1f} us")
        for t, cfg in results[:3]:
            print(f"      {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s  x{t_def / t:4.2f} vs default  {cfg}")
        if results:
            best[(m, n, k)] = (*results[0], t_def)


def bench_gemv(sweep: bool = False, only: str | None = None, rows: tuple[int, ...] = GEMV_ROWS) -> None:
    """Decode GEMMs y = x @ W^T (bf16, M rows): heron.kernels.gemv with its default configs against F.linear
    (cuBLAS), both by CUDA-graph replay over rotating weight copies, for the per-layer matrices and the LM head
    of the GEMV_MODELS; then per model the sum over one decode step (layers x per-layer + head).
    TB/s counts the weight bytes. `sweep`: also search `_gemv_candidates` per shape and print the best."""
    import torch.nn.functional as F

    from heron.kernels.gemm.blas import linear_lt
    from heron.kernels.gemv import MAX_M, gemv, pick_config

    dev, start, best = torch.device("cuda"), time.perf_counter(), {}
    print(f"gemv: {torch.cuda.get_device_name(dev)}, bf16, CUDA-graph replay, weights rotated past the L2 cache")
    for model, (layers, per_layer, head) in GEMV_MODELS.items():
        if only and only.lower() not in model.lower():
            continue
        step = {m: [0.0, 0.0, 0.0] for m in rows}  # torch s, gemv s, best-of-sweep s per decode step
        lt = dict.fromkeys(rows, 0.0)  # cuBLASLt s per decode step
        step_bytes = 0
        for name, n, k in [*per_layer, head]:
            count = 1 if (name, n, k) == head else layers
            weights, nbytes = _weight_copies(n, k, dev), 2 * n * k
            step_bytes += count * nbytes
            print(f"{model} {name} N={n} K={k} ({nbytes / 1e6:.1f} MB, x{count} per step)")
            xs, default = {}, {}
            for m in rows:
                x = xs[m] = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_torch = _time_rotating(lambda w: F.linear(x, w), weights)
                line = (
                    f"  M={m:<3d} torch {t_torch * 1e6:8.1f} us {nbytes / t_torch / 1e12:5.2f} TB/s "
                    f"{2 * m * n * k / t_torch / 1e12:4.0f} TFLOP/s"
                )
                step[m][0] += count * t_torch
                if m > MAX_M:  # cuBLASLt's heuristics pick other kernels than cuBLAS's
                    t_lt = _time_rotating(lambda w: linear_lt(x, w), weights)
                    line += f" | cublasLt {t_lt * 1e6:8.1f} us x{t_torch / t_lt:4.2f}"
                    lt[m] += count * t_lt
                else:
                    cfg = pick_config(m, n, k, x.dtype, dev)
                    t = default[m] = _time_rotating(lambda w: gemv(x, w), weights)
                    ref = F.linear(x.float(), weights[0].float())
                    diff = (gemv(x, weights[0]).float() - ref).abs().max().item()
                    assert diff < 2e-2 * ref.abs().max().item() + 1e-2, f"gemv disagrees with F.linear: {diff:.3g}"
                    line += (
                        f" | gemv {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s x{t_torch / t:4.2f}"
                        f" (max|diff| {diff:.2g}) {cfg}"
                    )
                    step[m][1] += count * t
                print(line)
            if sweep and all(m in xs for m in (1, 8, 16)):
                _gemv_sweep(n, k, xs, weights, default, best)
                for m in default:
                    step[m][2] += count * min(default[m], best.get((m, n, k), (default[m],))[0])
            del weights
        print(f"{model}: the weight GEMMs of one decode step ({step_bytes / 1e9:.2f} GB)")
        for m, (t_torch, t_gemv, t_best) in step.items():
            line = (
                f"  M={m:<3d} torch {t_torch * 1e6:8.1f} us {step_bytes / t_torch / 1e12:5.2f} TB/s "
                f"{m * step_bytes / t_torch / 1e12:6.1f} TFLOP/s"
            )  # 2 FLOPs per 2-byte weight and row
            if lt[m]:
                line += f" | cublasLt {lt[m] * 1e6:8.1f} us"
            if t_gemv:
                line += f" | gemv {t_gemv * 1e6:8.1f} us {step_bytes / t_gemv / 1e12:5.2f} TB/s"
            if t_best:
                line += f" | swept best {t_best * 1e6:8.1f} us {step_bytes / t_best / 1e12:5.2f} TB/s"
            print(line)
    if sweep:
        print("swept configs beating the default by > 3% (for gemv.CONFIGS, or a better default_config):")
        for (m, n, k), (t, cfg, t_def) in sorted(best.items()):
            if t < 0.97 * t_def:
                print(f"  CONFIGS[({m}, {n}, {k})] = {cfg!r}  # {t * 1e6:.1f} us, default {t_def * 1e6:.1f} us")
    print(f"gemv bench: {time.perf_counter() - start:.0f} s")
