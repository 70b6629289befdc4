"""Micro-benchmark of the attention kernels on a GPU: `python -m heron.bench.kernels [--sweep]`.

Decode: B sequences of uniform random length in [min_len, max_len], H query / Hkv KV heads, head_dim D,
block size 16, bf16, shuffled block tables. Reports the time per call (CUDA-graph replay, so launch overhead
is excluded as in the engine's decode step) and the achieved bandwidth over the K/V bytes read. Prefill:
whole prompts and chunks over cached prefixes, reports TFLOP/s of the causal attention (`--prefill-only`:
just that, e.g. with --sweep).

`python -m heron.bench.kernels --vs-flashinfer [--save-result]`: the recorded `kernels` benchmark, ours
against FlashInfer's kernels on the same inputs (`bench_vs_flashinfer`), saved as benchmarks/results/kernels.json.

`python -m heron.bench.kernels --gemv [--sweep] [--only qwen|llama] [--rows 1,8,16,...]`: the decode weight GEMMs,
heron.kernels.gemv against cuBLAS (and cuBLASLt past 16 rows) (`bench_gemv`); --sweep searches gemv's configs per
shape; `--fp8`: the float8 GEMV against the bf16 one (`bench_gemv_fp8`).
`--decode-only [--sweep]`: the decode kernel on the `kernels` case and two offline Qwen3-8B decode steps.

`python -m heron.bench.kernels --moe [--sweep] [--rows 1,4,16,...]`: the fused MoE kernels on Qwen3-30B-A3B's experts
(`bench_moe`); --sweep searches their configs per token count.

`python -m heron.bench.kernels --sampling [--sweep] [--rows 1,64,...]`: heron.kernels.sampling.sample_tokens on
Qwen3's vocabulary (`bench_sampling`), checked bit for bit against the PyTorch reference; --sweep also times
other warps / splits.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from heron.bench.kernel_timing import compile_ahead, paged_batch, time_configs, time_graph
from heron.bench.kernels_flashinfer import bench_vs_flashinfer
from heron.bench.kernels_gemv import GEMV_ROWS, bench_gemv, bench_gemv_fp8
from heron.bench.kernels_moe import MOE_ROWS, bench_moe


def _decode_call(batch: int, lens: tuple[int, int], seed: int, shape: tuple[int, int, int, int]):
    """call(cfg) = the paged decode kernel with config cfg on B sequences of uniform random lengths in `lens`
    (shape: heads, KV heads, head dim, block size); cfg's `longest_first=True` passes the engine's launch order
    (a flag, not the order itself, so that configs stay picklable for compile_ahead's workers). Also returns
    the K/V bytes it reads and the lengths."""
    from heron.kernels.paged_decode import longest_first, paged_decode_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(lens[0], lens[1] + 1, (batch,), generator=gen).tolist()
    cache, tables, lens_t = paged_batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * cache.element_size()
    order = longest_first(lens_t)

    def call(cfg: dict) -> torch.Tensor:
        cfg = dict(cfg)
        ordered = cfg.pop("longest_first", False)
        return paged_decode_attention(
            q, cache, tables, lens_t, head_dim**-0.5, out=out, order=order if ordered else None, **cfg
        )

    return call, kv_bytes, seq_lens


def _decode_kernel_call(build):
    return build()[0]


def _decode_configs(default_p: int) -> list[dict]:
    """The decode sweep: P / 2, P and 2P partitions, tiles of 32-128 keys, 4/8 warps, 2/3 stages; launched as the
    triton backend launches them (longest first, KV heads innermost, at <= 2 partitions)."""
    parts = sorted({max(1, default_p // 2), default_p, 2 * default_p})
    return [
        dict(
            num_partitions=p,
            block_n=bn,
            num_warps=w,
            num_stages=s,
            **(dict(longest_first=True, heads_first=True) if p <= 2 else {}),
        )
        for p, bn, w, s in itertools.product(parts, (32, 64, 128), (4, 8), (2, 3))
    ]


def bench_decode(
    batch=64, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, min_len=1024, max_len=2048, sweep=False, seed=0
):
    import functools

    from heron.kernels.paged_decode import default_num_partitions

    shape = (num_heads, num_kv_heads, head_dim, block_size)
    build = functools.partial(_decode_call, batch, (min_len, max_len), seed, shape)
    call, kv_bytes, seq_lens = build()
    default_p = default_num_partitions(batch, num_kv_heads, torch.device("cuda"))
    print(
        f"decode B={batch} H={num_heads} Hkv={num_kv_heads} D={head_dim} bs={block_size} "
        f"len {min_len}-{max_len} (mean {sum(seq_lens) / batch:.0f}): K/V {kv_bytes / 1e6:.1f} MB, "
        f"at 4.0 TB/s {kv_bytes / 4.0e12 * 1e6:.1f} us; default P={default_p}"
    )
    configs = [
        dict(num_partitions=None, longest_first=lf, heads_first=hf) for hf in (False, True) for lf in (False, True)
    ]
    if sweep:
        configs += _decode_configs(default_p)
        compile_ahead(functools.partial(_decode_kernel_call, build), configs)
    time_configs(configs, call, lambda t: f"{kv_bytes / t / 1e12:5.2f} TB/s", iters=50, best=sweep)


def _prefill_call(prefix: list[int], q_len: int, seed: int, shape: tuple[int, int, int, int]):
    """call(cfg) = the paged prefill kernel with config cfg on q_len new tokens per sequence over cached prefixes
    of the given lengths (shape: heads, KV heads, head dim, block size); the sweep's builder."""
    from heron.kernels.paged_prefill import paged_prefill_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    dev, gen, b = torch.device("cuda"), torch.Generator().manual_seed(seed), len(prefix)
    cache, tables, lens = paged_batch([n + q_len for n in prefix], block_size, num_kv_heads, head_dim, dev, gen)
    qsl = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    q = torch.randn(b * q_len, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out, scale = torch.empty_like(q), head_dim**-0.5
    return lambda cfg: paged_prefill_attention(q, cache, tables, lens, qsl, q_len, scale, out=out, **cfg)


def bench_prefill(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=False, seed=1):
    """The paged prefill kernel on two shapes: 4 whole 2048-token prompts (the prefill benchmark's steps) and
    256 new tokens per sequence over 64 cached contexts of 1024-2048 tokens (the `kernels` benchmark's case).
    Reports TFLOP/s of the causal attention; with `sweep` (the second shape only), every tile/warps/stages config
    (8 warps held to 128 registers: two programs per SM) and the five best."""
    import functools

    import torch.nn.functional as F

    dev, shape = torch.device("cuda"), (num_heads, num_kv_heads, head_dim, block_size)
    ctx = torch.randint(1024, 2049, (64,), generator=torch.Generator().manual_seed(seed)).tolist()
    cases = [("4 x 2048-token prompts", [0] * 4, 2048), ("64 x 256 new tokens over 1024-2048 cached", ctx, 256)]
    for label, prefix, q_len in cases[1:] if sweep else cases:
        b = len(prefix)
        keys = sum(q_len * n + q_len * (q_len + 1) // 2 for n in prefix)  # causal: query t sees n + t + 1 keys
        flops = 4 * num_heads * head_dim * keys
        print(f"prefill {label}: H={num_heads} Hkv={num_kv_heads} D={head_dim}")
        build = functools.partial(_prefill_call, prefix, q_len, seed, shape)
        configs = [dict()]
        if sweep:
            configs += [
                dict(block_m=m, block_n=n, num_warps=w, num_stages=s, maxnreg=128 if w == 8 else 255)
                for m, n, w, s in itertools.product([64, 128, 256], [16, 32, 64], [4, 8], [3, 4])
            ]
            compile_ahead(build, configs)
        time_configs(configs, build(), lambda t: f"{flops / t / 1e12:6.1f} TFLOP/s", iters=10, best=sweep)
        if not any(prefix):
            qs = torch.randn(b, num_heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
            ks = torch.randn(b, num_kv_heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
            t = time_graph(
                lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True), iters=10
            )
            print(f"  torch SDPA (contiguous K/V, for scale): {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s")


SAMPLING_ROWS = (1, 64, 200, 256)  # 200-256: the offline Qwen3-8B run's decode batches


SAMPLING_VOCAB = 151936  # Qwen3's


def _sampling_configs(splits: int) -> list[dict]:
    """The sweep's grid: 4 or 8 warps x half, once, twice and four times the default plan's splits."""
    return [
        {"num_warps": w, "num_splits": s}
        for w in (4, 8)
        for s in sorted({max(1, splits // 2), splits, 2 * splits, 4 * splits})
    ]


def bench_sampling(rows: tuple[int, ...] = SAMPLING_ROWS, vocab: int = SAMPLING_VOCAB, sweep: bool = False) -> None:
    """heron.kernels.sampling.sample_tokens on float32 logits [R, vocab], temperature 0.6, random seeds and
    counters, by CUDA-graph replay: without thresholds, with thresholds of -inf (every tile drawn, plus the
    skip test) and at each row's 50th largest logit (top-k 50: most tiles skipped). Each variant is first
    checked against sample_tokens_torch (the same tokens, bit for bit). G elem/s counts R * vocab logits.
    `sweep`: also `_sampling_configs` without thresholds."""
    from heron.executor.sampler import sample_tokens_torch
    from heron.kernels.sampling import default_plan, sample_tokens

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"sampling: {torch.cuda.get_device_name(dev)}, float32 logits, V={vocab}, T=0.6, CUDA-graph replay")
    for r in rows:
        logits = torch.randn(r, vocab, device=dev, generator=gen) * 3
        temp = torch.full((r,), 0.6, device=dev)
        seeds = torch.randint(-(2**63), 2**63 - 1, (r,), device=dev, generator=gen)
        ctrs = torch.randint(0, 2**40, (r,), device=dev, generator=gen)
        block, splits = default_plan(r, vocab, dev)
        variants = {
            "no thr": None,
            "thr -inf": torch.full((r,), float("-inf"), device=dev),
            "top-k 50": logits.topk(50, dim=-1).values[:, -1].contiguous(),
        }
        for name, thr in variants.items():
            ref = sample_tokens_torch(logits, temp, thr, seeds, ctrs)
            assert torch.equal(sample_tokens(logits, temp, thr, seeds, ctrs), ref), f"R={r} {name}: not the reference"
            t = time_graph(lambda thr=thr: sample_tokens(logits, temp, thr, seeds, ctrs))
            print(
                f"  R={r:<3d} {name:8s} {t * 1e6:8.1f} us {r * vocab / t / 1e9:6.1f} G elem/s"
                f"  (block {block}, {splits} splits, 4 warps)"
            )
        if sweep:
            want = sample_tokens(logits, temp, None, seeds, ctrs)
            for cfg in _sampling_configs(splits):
                assert torch.equal(sample_tokens(logits, temp, None, seeds, ctrs, **cfg), want), cfg
                t = time_graph(lambda cfg=cfg: sample_tokens(logits, temp, None, seeds, ctrs, **cfg))
                print(f"    sweep no thr {t * 1e6:8.1f} us {r * vocab / t / 1e9:6.1f} G elem/s  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--vs-flashinfer", action="store_true", help="the recorded `kernels` benchmark: ours against FlashInfer"
    )
    ap.add_argument(
        "--save-result", action="store_true", help="with --vs-flashinfer: write benchmarks/results/kernels.json"
    )
    ap.add_argument(
        "--gemv",
        action="store_true",
        help="the decode GEMMs: heron.kernels.gemv against cuBLAS (with --sweep: search its configs)",
    )
    ap.add_argument(
        "--moe", action="store_true", help="the fused MoE kernels on Qwen3-30B-A3B's experts (with --sweep: tune)"
    )
    ap.add_argument("--prefill-only", action="store_true", help="only the paged prefill kernel (with --sweep: tune it)")
    ap.add_argument("--decode-only", action="store_true", help="only the paged decode kernel (with --sweep: tune it)")
    ap.add_argument(
        "--sampling",
        action="store_true",
        help="the one-pass sampler on Qwen3's vocabulary (with --sweep: other warps / splits)",
    )
    ap.add_argument("--only", help="with --gemv: only the models whose name contains this (qwen, llama)")
    ap.add_argument("--fp8", action="store_true", help="with --gemv: the float8 GEMV against the bf16 one")
    ap.add_argument(
        "--rows",
        help=f"with --gemv / --sampling / --moe: comma-separated row counts (default: {','.join(map(str, GEMV_ROWS))}"
        f" / {','.join(map(str, SAMPLING_ROWS))} / {','.join(map(str, MOE_ROWS))})",
    )
    args = ap.parse_args()
    if args.sampling:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else SAMPLING_ROWS
        bench_sampling(rows=rows, sweep=args.sweep)
        return
    if args.moe:
        bench_moe(sweep=args.sweep, rows=tuple(int(r) for r in args.rows.split(",")) if args.rows else MOE_ROWS)
        return
    if args.gemv and args.fp8:
        bench_gemv_fp8(sweep=args.sweep, only=args.only)
        return
    if args.gemv:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else GEMV_ROWS
        bench_gemv(sweep=args.sweep, only=args.only, rows=rows)
        return
    if args.vs_flashinfer:
        bench_vs_flashinfer(save=args.save_result, batch=args.batch)
        return
    if args.prefill_only:
        bench_prefill(sweep=args.sweep)
        return
    if args.decode_only:  # the `kernels` benchmark's case, offline Qwen3-8B decode steps (batch ~200, ~100), and
        # the offline run's spread of contexts (prompts 100-1024 tokens plus 0-1024 generated)
        for batch, lo, hi in (
            (args.batch, 1024, 2048),
            (200, 500, 1200),
            (100, 800, 1600),
            (200, 100, 2048),
            (100, 100, 2048),
            (80, 100, 2048),
            (48, 100, 2048),
        ):
            bench_decode(batch=batch, min_len=lo, max_len=hi, sweep=args.sweep)
        return
    bench_decode(batch=args.batch, sweep=args.sweep)
    bench_decode(batch=args.batch, head_dim=64, num_heads=32, num_kv_heads=8)
    bench_decode(batch=8, min_len=1024, max_len=2048)
    bench_decode(batch=args.batch, block_size=32)
    bench_prefill(sweep=args.sweep)


if __name__ == "__main__":
    main()
