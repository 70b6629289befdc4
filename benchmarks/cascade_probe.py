"""Cascade attention on the GPU, one layer's decode attention at the prefix workload's shapes: 256 sequences in 16
groups, each group sharing a 2,000-token prefix, each sequence 50-450 tokens of its own; Qwen3-0.6B's heads (16 /
8) and Qwen3-8B's (32 / 8), D 128, bf16, block 16. Times the plain split-KV decode kernel against the cascade
(prefix kernel + decode kernel over the suffixes with the merge), and sweeps the prefix kernel's tile, warps,
stages and partitions. Outputs are checked against the plain kernel.

    python benchmarks/cascade_probe.py           (the sweep)
    python benchmarks/cascade_probe.py suffix    (the decode kernel's tiles over the sequences' own keys)
    python benchmarks/cascade_probe.py eager     (an eager mixed step's launches, host time)
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from triton.testing import do_bench

from heron.attention.cascade import CascadePlanner
from heron.kernels import cascade
from heron.kernels.paged_decode import (
    default_num_partitions,
    longest_first,
    make_decode_workspace,
    paged_decode_attention,
)

LONERS = 8  # `suffix`: sequences outside any group beside 248 grouped ones


def structure(rng, batch: int = 256, groups: int = 16, prefix: int = 2000, bs: int = 16, loners: int = 0):
    """Block tables [batch, width] and lengths: group g's members share its prefix blocks, then blocks of their own;
    the last `loners` sequences hold a copy of their prefix of their own (two prompts of one prefix computed in
    the same step share no blocks), so no group takes them and they walk all of their keys in the second pass."""
    pre = prefix // bs
    own = rng.integers(50, 451, batch)
    lens = prefix + own
    width = pre + int(-(-own.max() // bs))
    tables = np.zeros((batch, width), dtype=np.int32)
    next_block = groups * pre
    for i in range(batch):
        g = i % groups
        tables[i, :pre] = np.arange(g * pre, (g + 1) * pre)
        if i >= batch - loners:
            tables[i, :pre] = np.arange(next_block, next_block + pre)
            next_block += pre
        n = -(-int(own[i]) // bs)
        tables[i, pre : pre + n] = np.arange(next_block, next_block + n)
        next_block += n
    return tables, lens.astype(np.int32), next_block


def _timed(label: str, fn, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float] | None:
    """fn's time (ms) and its output's relative error against ref's; None, said, for a configuration that does
    not compile or fit."""
    try:
        fn()
        t = do_bench(fn)
    except Exception as e:  # noqa: BLE001 (a configuration that does not compile or fit: say so, go on)
        print(f"  {label}: {type(e).__name__}")
        return None
    return t, ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    tables, lens, num_blocks = structure(rng)
    batch, bs, d = len(lens), 16, 128
    for heads, kv_heads in ((16, 8), (32, 8)):
        cache = torch.randn(2, num_blocks, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
        bt, sl = torch.from_numpy(tables).to(dev), torch.from_numpy(lens).to(dev)
        parts = default_num_partitions(batch, kv_heads, dev)
        ws = make_decode_workspace(batch, heads, kv_heads, d, parts, dev) if parts > 1 else None
        order = longest_first(sl)
        plain_out = torch.empty_like(q)

        def plain():
            paged_decode_attention(
                q, cache, bt, sl, d**-0.5, out=plain_out, num_partitions=parts, workspace=ws, order=order,
                heads_first=True,
            )  # fmt: skip

        plain()
        t_plain = do_bench(plain)
        kv_bytes = int(lens.sum()) * kv_heads * d * 2 * 2
        print(f"heads {heads}/{kv_heads}: plain decode {t_plain * 1e3:.1f} us ({kv_bytes / t_plain / 1e9:.2f} TB/s)")
        for block_m, block_n, warps, stages, pp in itertools.product((64, 128), (32, 64), (4, 8), (2, 3), (2, 4, 8)):
            seqs = cascade.tile_seqs(heads, kv_heads, block_m)
            planner = CascadePlanner(batch, seqs, bs, kv_heads * d * 4)
            packed = np.zeros(planner.size, dtype=np.int32)
            planner.write(packed, batch, planner.groups(tables, lens))
            kv_start, tile_len, members = planner.views(torch.from_numpy(packed).to(dev), batch)
            prefix_ws = cascade.make_prefix_workspace(batch, heads, d, dev, parts=pp)
            out = torch.empty_like(q)

            def pre():
                return cascade.cascade_prefix_attention(
                    q, cache, bt, tile_len, members, d**-0.5, prefix_ws, block_n=block_n, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip

            def casc():
                paged_decode_attention(
                    q, cache, bt, sl, d**-0.5, out=out, num_partitions=parts, workspace=ws, order=order,
                    heads_first=True, kv_start=kv_start, prefix=pre(),
                )  # fmt: skip

            label = f"M {block_m} N {block_n} w {warps} s {stages} parts {pp}"
            if (timed := _timed(label, casc, out, plain_out)) is None:
                continue
            t_pre = do_bench(pre)
            t, err = timed
            print(
                f"  {label}: cascade {t * 1e3:.1f} us (prefix {t_pre * 1e3:.1f}), {t_plain / t:.2f}x plain, "
                f"rel err {err:.1e}"
            )


def suffix() -> None:
    """The cascade's second launch alone: the decode kernel over each sequence's own keys (its shared prefix's
    partials merged), with its tile (keys), stages, warps and partitions swept, each launched in the order of the
    sequences' lengths (today's) and of their own keys. Its default tile, 128 keys with 3 stages (one program per
    SM), is sized for long runs of keys; here a grouped sequence has 50-450, and LONERS sequences outside any
    group ~2,250 (session 22's 16-key tile, the best here without them, made the prefix workload 20% slower:
    likely those rows' tail). The prefix workload's first decode steps spent 111 us a layer in it (H200
    profile, Qwen3-0.6B, ~135 own keys a sequence: ~35 us of reading at the copy rate). Outputs checked against
    the plain kernel."""
    for loners in (0, LONERS):
        print(f"== {loners} of 256 sequences outside any group")
        _suffix_sweep(loners)


def _suffix_sweep(loners: int) -> None:
    dev = torch.device("cuda")
    tables, lens, num_blocks = structure(np.random.default_rng(0), loners=loners)
    batch, bs, d = len(lens), 16, 128
    for heads, kv_heads in ((16, 8), (32, 8)):
        cache = torch.randn(2, num_blocks, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
        bt, sl = torch.from_numpy(tables).to(dev), torch.from_numpy(lens).to(dev)
        plain_out = torch.empty_like(q)
        paged_decode_attention(q, cache, bt, sl, d**-0.5, out=plain_out)
        planner = CascadePlanner(batch, cascade.tile_seqs(heads, kv_heads), bs, kv_heads * d * 4)
        packed = np.zeros(planner.size, dtype=np.int32)
        planner.write(packed, batch, planner.groups(tables, lens))
        kv_start, tile_len, members = planner.views(torch.from_numpy(packed).to(dev), batch)
        prefix = cascade.cascade_prefix_attention(
            q, cache, bt, tile_len, members, d**-0.5, cascade.make_prefix_workspace(batch, heads, d, dev)
        )
        own_keys = sl - kv_start
        own_bytes = int(own_keys.sum()) * kv_heads * d * 2 * 2
        orders = {"len": longest_first(sl), "own": longest_first(own_keys)}
        print(f"heads {heads}/{kv_heads}: own keys {own_bytes / 1e6:.0f} MB a layer")
        sweep = itertools.product((16, 32, 64, 128), (2, 3), (2, 4), (1, 2), orders)
        for block_n, stages, warps, parts, by in sweep:
            ws = make_decode_workspace(batch, heads, kv_heads, d, parts, dev) if parts > 1 else None
            out = torch.empty_like(q)

            def own():
                paged_decode_attention(
                    q, cache, bt, sl, d**-0.5, out=out, num_partitions=parts, workspace=ws,
                    order=orders[by], heads_first=True, kv_start=kv_start, prefix=prefix,
                    block_n=block_n, num_warps=warps, num_stages=stages,
                )  # fmt: skip

            label = f"N {block_n} s {stages} w {warps} parts {parts} order {by}"
            if (timed := _timed(label, own, out, plain_out)) is not None:
                t, err = timed
                print(f"  {label}: {t * 1e3:.1f} us ({own_bytes / t / 1e9:.2f} TB/s), rel err {err:.1e}")


def eager_mixed() -> None:
    """The host time of a mixed step's cascade launches run eagerly (past the captured graphs' 2,048 tokens): 106
    sequences, 100 of them decode rows sharing their group's prefix and 6 prompt chunks, 8,192 query rows in all,
    Qwen3-0.6B's heads, each layer's prefix then decode launch timed on the host without a sync (the prefix
    workload's profile showed the GPU idle ~7.5 ms between the two in every layer of such steps)."""
    import statistics
    import time

    dev = torch.device("cuda")
    tables, lens, num_blocks = structure(np.random.default_rng(1), batch=106)
    batch, bs, d, heads, kv_heads, decode_rows = len(lens), 16, 128, 16, 8, 100
    q_lens = np.ones(batch, dtype=np.int32)
    q_lens[decode_rows:] = (8192 - decode_rows) // (batch - decode_rows)
    q_lens[-1] += 8192 - int(q_lens.sum())
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)).to(dev)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(8192, heads, d, device=dev, dtype=torch.bfloat16)
    bt, sl = torch.from_numpy(tables).to(dev), torch.from_numpy(lens).to(dev)
    planner = CascadePlanner(batch, cascade.tile_seqs(heads, kv_heads, 64), bs, kv_heads * d * 4)
    packed = np.zeros(planner.size, dtype=np.int32)
    planner.write(packed, batch, planner.groups(tables, np.where(q_lens == 1, lens, 0)))
    kv_start, tile_len, members = planner.views(torch.from_numpy(packed).to(dev), batch)
    prefix_ws = cascade.make_prefix_workspace(batch, heads, d, dev)
    parts = default_num_partitions(batch, kv_heads, dev)
    ws = make_decode_workspace(batch, heads, kv_heads, d, parts, dev) if parts > 1 else None
    out = torch.empty_like(q)
    host: dict[str, list[float]] = {"prefix": [], "decode": []}
    for _ in range(3 * 28):  # three steps of 28 layers; the first call compiles
        t0 = time.perf_counter()
        prefix = cascade.cascade_prefix_attention(
            q, cache, bt, tile_len, members, d**-0.5, prefix_ws, query_start_loc=qsl
        )
        t1 = time.perf_counter()
        paged_decode_attention(
            q, cache, bt, sl, d**-0.5, out=out, num_partitions=parts, workspace=ws, query_start_loc=qsl,
            kv_start=kv_start, prefix=prefix,
        )  # fmt: skip
        host["prefix"].append(t1 - t0)
        host["decode"].append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    for name, ts in host.items():
        ms = [1e3 * t for t in ts[1:]]
        print(
            f"eager mixed {name} launch (host, no sync): first {1e3 * ts[0]:.1f} ms, then median "
            f"{statistics.median(ms):.3f} ms, max {max(ms):.3f} ms over {len(ms)} calls (partitions {parts})"
        )


if __name__ == "__main__":
    import sys

    {"eager": eager_mixed, "suffix": suffix}.get(sys.argv[1] if sys.argv[1:] else "", main)()
