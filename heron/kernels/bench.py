"""Micro-benchmark of the attention kernels on a GPU: `python -m heron.kernels.bench [--sweep]`.

Decode: B sequences of uniform random length in [min_len, max_len], H query / Hkv KV heads, head_dim D,
block size 16, bf16, shuffled block tables. Reports the time per call (CUDA-graph replay, so launch overhead
is excluded as in the engine's decode step) and the achieved bandwidth over the K/V bytes read. Prefill:
long prompts, reports TFLOP/s of the causal attention (and torch SDPA on contiguous K/V for scale).
"""

from __future__ import annotations

import argparse
import itertools

import torch


def _batch(seq_lens, block_size, num_kv_heads, head_dim, device, gen):
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    return cache, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _time_graph(fn, iters: int = 50) -> float:
    """Mean seconds per call, replaying a CUDA graph of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * iters)


def bench_decode(batch=64, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, min_len=1024,
                 max_len=2048, sweep=False, seed=0):
    from heron.kernels.paged_decode import default_num_partitions, paged_decode_attention

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    cache, tables, lens = _batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * cache.element_size()
    scale = head_dim ** -0.5
    default_p = default_num_partitions(batch, num_kv_heads, dev)
    print(f"decode B={batch} H={num_heads} Hkv={num_kv_heads} D={head_dim} bs={block_size} "
          f"len {min_len}-{max_len} (mean {sum(seq_lens) / batch:.0f}): K/V {kv_bytes / 1e6:.1f} MB, "
          f"at 4.0 TB/s {kv_bytes / 4.0e12 * 1e6:.1f} us; default P={default_p}")
    configs = [dict(num_partitions=None)]
    if sweep:
        configs += [dict(num_partitions=p, block_n=bn, num_warps=w, num_stages=s)
                    for p, bn, w, s in itertools.product([1, 2, 4, 8], [32, 64, 128], [4, 8], [1, 2, 3])]
    results = []
    for cfg in configs:
        fn = lambda cfg=cfg: paged_decode_attention(q, cache, tables, lens, scale, out=out, **cfg)  # noqa: E731
        try:
            t = _time_graph(fn)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        results.append((t, cfg))
        print(f"  {cfg}: {t * 1e6:8.1f} us  {kv_bytes / t / 1e12:5.2f} TB/s")
    if sweep and results:
        results.sort(key=lambda r: r[0])
        print("  best:", [f"{t * 1e6:.1f} us {c}" for t, c in results[:5]])


def bench_prefill(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, prompt=2048, num_seqs=4,
                  sweep=False):
    import torch.nn.functional as F

    from heron.kernels.paged_prefill import paged_prefill_attention

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    seq_lens = [prompt] * num_seqs
    cache, tables, lens = _batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    qsl = torch.arange(0, (num_seqs + 1) * prompt, prompt, dtype=torch.int32, device=dev)
    q = torch.randn(num_seqs * prompt, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    flops = 4 * num_seqs * num_heads * head_dim * prompt * prompt / 2  # causal: half the square
    print(f"prefill {num_seqs} x {prompt} tokens H={num_heads} Hkv={num_kv_heads} D={head_dim}")
    configs = [dict()]
    if sweep:
        configs += [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                    for m, n, w, s in itertools.product([64, 128], [32, 64, 128], [4, 8], [1, 2, 3])]
    for cfg in configs:
        fn = lambda cfg=cfg: paged_prefill_attention(q, cache, tables, lens, qsl, prompt, scale, out=out,  # noqa
                                                     **cfg)
        try:
            t = _time_graph(fn, iters=10)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        print(f"  {cfg}: {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s")
    qs = q.view(num_seqs, prompt, num_heads, head_dim).transpose(1, 2)
    ks = torch.randn(num_seqs, num_kv_heads, prompt, head_dim, device=dev, dtype=torch.bfloat16)
    t = _time_graph(lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True), iters=10)
    print(f"  torch SDPA (contiguous K/V, for scale): {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    bench_decode(batch=args.batch, sweep=args.sweep)
    bench_decode(batch=args.batch, head_dim=64, num_heads=32, num_kv_heads=8)
    bench_decode(batch=8, min_len=1024, max_len=2048)
    bench_decode(batch=args.batch, block_size=32)
    bench_prefill(sweep=args.sweep)


if __name__ == "__main__":
    main()
