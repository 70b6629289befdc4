"""Heron's Triton kernels against the PyTorch references: split-KV decode, paged prefill, and the
"triton" attention backend against the "torch" one. On CPU they run under Triton's interpreter with small
shapes; the `gpu`-marked variants with production shapes (and CUDA-graph capture) run only on CUDA."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from heron.attention.torch_ref import TorchAttentionBackend, paged_attention_ref  # noqa: E402
from heron.kernels.paged_decode import (
    _paged_decode_kernel,
    default_block_n,
    longest_first,  # noqa: E402
    make_decode_workspace,
    paged_decode_attention,
)
from heron.kernels.paged_prefill import make_split_workspace, paged_prefill_attention  # noqa: E402
from heron.kernels.reference import paged_decode_ref, paged_prefill_ref, write_kv_ref  # noqa: E402
from tests.kernels.kernel_utils import assert_close, make_batch, make_cache, pick_device, skip_unless_runnable  # noqa: E402

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (large shapes)")

skip_unless_runnable(_paged_decode_kernel, DEVICE)

# (num_heads, num_kv_heads): GQA ratios 1, 4, 8
GQA = [(4, 4), (8, 2), (16, 2)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _oracle(q, kv_cache, meta, scale):
    """torch_ref.paged_attention_ref in float32 (the engine's own oracle)."""
    return paged_attention_ref(q.float(), kv_cache.float(), meta, scale)


def _nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


# -- decode --------------------------------------------------------------------------------------------------

DECODE_CASES = [
    # heads, head_dim, block_size, partitions, seq_lens
    (GQA[0], 64, 16, 1, [1, 17, 50]),
    (GQA[1], 128, 16, 3, [33, 1, 96, 64]),
    (GQA[2], 64, 32, 4, [130, 7, 64]),
    (GQA[2], 128, 16, 2, [5, 100]),
    (GQA[1], 64, 32, 1, [40, 200]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim,block_size,parts,seq_lens", DECODE_CASES)
def test_paged_decode(dtype, heads, head_dim, block_size, parts, seq_lens):
    num_heads, num_kv_heads = heads
    gen = _gen(hash((num_heads, head_dim, block_size, parts)) % 2**31)
    meta = make_batch(seq_lens, [1] * len(seq_lens), block_size, DEVICE, gen)
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        scale,
        out=_nan_like(q),
        num_partitions=parts,
        block_n=16 if not ON_GPU else None,
    )
    assert_close(out, _oracle(q, cache, meta, scale), dtype, "decode vs torch_ref")
    assert_close(
        out,
        paged_decode_ref(q.float(), cache, meta.block_tables, meta.seq_lens, scale),
        dtype,
        "decode vs paged_decode_ref",
    )


def test_decode_tile_follows_partitions_and_cache_dtype():
    """128-key tiles only for a 16-bit cache with <= 2 partitions (large batches); a float32 cache keeps 64
    (128 would not fit in the shared memory of ~100 KB GPUs); head_dim 256 takes 32; the block size is a floor."""
    assert default_block_n(16, 1, 2, 128) == default_block_n(16, 2, 2, 128) == default_block_n(16, 1, 2, 64) == 128
    assert default_block_n(16, 4, 2, 128) == default_block_n(16, 1, 4, 128) == 64
    assert default_block_n(16, 1, 2, 256) == default_block_n(16, 1, 4, 256) == 32
    assert default_block_n(256, 16, 4, 128) == 256


def test_paged_decode_empty_sequence_gives_zeros():
    """A padded batch entry (seq_len 0) yields zeros, not NaN, with one or several partitions."""
    gen = _gen(3)
    meta = make_batch([20, 0, 9], [1, 0, 1], 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.float16, DEVICE, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE, torch.float16)
    for parts in (1, 2):
        out = paged_decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, 0.125, out=_nan_like(q), num_partitions=parts, block_n=16
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = paged_decode_ref(q, cache, meta.block_tables, meta.seq_lens, 0.125)
        assert_close(out, ref, torch.float16, f"P={parts}")


def test_paged_decode_counters_reset_and_partitions_combine_deterministically():
    """The partition that arrives last combines them and leaves the arrival counters at zero, so repeated
    calls with one workspace (as a captured graph makes them) give equal outputs."""
    gen = _gen(5)
    meta = make_batch([70, 3, 129], [1, 1, 1], 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    ws = make_decode_workspace(3, 8, 2, 64, 4, DEVICE)
    call = lambda: paged_decode_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        0.125,
        out=_nan_like(q),  # noqa
        num_partitions=4,
        workspace=ws,
        block_n=16,
    )
    first = call()
    assert torch.count_nonzero(ws[3]) == 0
    assert torch.equal(call(), first)
    assert_close(first, _oracle(q, cache, meta, 0.125), torch.bfloat16, "P=4 with a passed workspace")


@pytest.mark.parametrize("parts", [1, 3])
def test_paged_decode_launch_order_changes_nothing(parts):
    """Programs launched longest sequence first (or in any order, KV heads innermost or not) compute what they
    compute in grid order, bit for bit, a padded row (seq_len 0) included."""
    gen = _gen(11)
    seq_lens = [9, 70, 0, 33, 129]
    meta = make_batch(seq_lens, [1, 1, 0, 1, 1], 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(5, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    order = longest_first(meta.seq_lens)
    assert order.tolist() == [4, 1, 3, 0, 2]
    call = lambda order, heads_first=False: paged_decode_attention(  # noqa: E731
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        0.125,
        out=_nan_like(q),
        num_partitions=parts,
        block_n=16,
        order=order,
        heads_first=heads_first,
    )
    want = call(None)
    assert torch.equal(call(order), want)
    assert torch.equal(call(torch.tensor([2, 0, 4, 3, 1], device=DEVICE)), want)
    assert torch.equal(call(None, heads_first=True), want)
    assert torch.equal(call(order, heads_first=True), want)


def test_paged_decode_skips_prefill_rows_with_query_start_loc():
    gen = _gen(4)
    q_lens, seq_lens = [1, 5, 1, 3], [30, 40, 1, 3]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    out = paged_decode_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        0.125,
        out=_nan_like(q),
        num_partitions=2,
        query_start_loc=meta.query_start_loc,
        block_n=16,
    )
    ref = _oracle(q, cache, meta, 0.125)
    decode_rows = [0, 6]  # query_start_loc of the sequences with one query token
    assert_close(out[decode_rows], ref[decode_rows], torch.bfloat16, "decode rows")
    others = [r for r in range(meta.num_tokens) if r not in decode_rows]
    assert torch.isnan(out[others]).all(), "rows of prefill sequences must be left to the prefill kernel"


# -- prefill -------------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # heads, head_dim, block_size, seq_lens, q_lens  (q == seq: a fresh prompt; q < seq: a chunk over a prefix)
    (GQA[0], 64, 16, [19, 40, 1], [19, 9, 1]),
    (GQA[1], 128, 16, [50, 23, 70], [50, 1, 17]),
    (GQA[2], 64, 32, [33, 80], [33, 12]),
    (GQA[2], 128, 16, [21, 5], [4, 5]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim,block_size,seq_lens,q_lens", PREFILL_CASES)
def test_paged_prefill(dtype, heads, head_dim, block_size, seq_lens, q_lens):
    num_heads, num_kv_heads = heads
    gen = _gen(hash((num_heads, head_dim, block_size, tuple(seq_lens))) % 2**31)
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale, out=_nan_like(q)
    )
    assert_close(out, _oracle(q, cache, meta, scale), dtype, "prefill vs torch_ref")
    assert_close(
        out,
        paged_prefill_ref(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale),
        dtype,
        "prefill vs paged_prefill_ref",
    )


def test_paged_prefill_tiles_and_skip_decode():
    """Several query tiles per sequence (block_m 32 with GQA 4: 8 tokens a tile), key tiles both unmasked and
    diagonal; skip_decode leaves one-token sequences alone."""
    gen = _gen(5)
    seq_lens, q_lens = [60, 31, 45], [27, 1, 45]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    out = paged_prefill_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        0.125,
        out=_nan_like(q),
        skip_decode=True,
        block_m=32,
        block_n=16,
    )
    ref = _oracle(q, cache, meta, 0.125)
    rows = [r for r in range(meta.num_tokens) if r != 27]
    assert_close(out[rows], ref[rows], torch.bfloat16, "prefill rows")
    assert torch.isnan(out[27]).all()


@pytest.mark.parametrize("tiles", [(32, 16), (16, 32)], ids=["bm32-bn16", "bm16-bn32"])
def test_paged_prefill_padded_group_tiles(tiles):
    """GQA 3 (a padded head per token in the tile's rows), key tiles of one and of two cache blocks (the table
    entries read a tile ahead cross a block mid-tile), a one-token chunk among fresh prompts and prefixes."""
    block_m, block_n = tiles
    gen = _gen(11)
    seq_lens, q_lens = [60, 31, 45, 100], [27, 1, 45, 8]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, 6, 64, generator=gen).to(DEVICE, torch.bfloat16)
    out = paged_prefill_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        0.125,
        out=_nan_like(q),
        block_m=block_m,
        block_n=block_n,
    )
    assert_close(out, _oracle(q, cache, meta, 0.125), torch.bfloat16, f"prefill {tiles}")


@pytest.mark.parametrize("splits,cap", [(2, None), (4, 5.0)])
def test_paged_prefill_split_keys(splits, cap):
    """Query tiles that share their keys among up to `splits` programs (2 key tiles of 16 a share here), in a
    narrow step (`splits` grid slots a tile): chunks behind long prefixes (split the most ways), behind a short
    one (2 ways), a fresh prompt (its early tiles whole, its late ones split) and a decode row left alone
    (skip_decode); with Gemma 2's soft cap too (the shares' log-sum-exps in its capped units). The merged result
    equals the oracle and the unsplit kernel's, the decode row's output is untouched, and the arrival counters
    are left zeroed."""
    seq_lens, q_lens = [200, 150, 40, 90], [20, 1, 40, 7]
    out, ws = _split_prefill(seq_lens, q_lens, splits, cap)
    assert torch.isfinite(ws[1][:, :20]).all(), "the long prefix's tiles are split every way"
    assert torch.isnan(ws[1][:, 21:29]).all(), "the fresh prompt's first tile ran whole"


def test_paged_prefill_split_keys_in_a_wide_step():
    """A prefill step of more sequences than SPLIT_SLOTS_MAX_SEQS keeps its grid (one slot per query tile of its
    longest chunk, 5 here): a 3-token chunk behind 200 cached tokens shares its keys 4 ways in the slots it
    leaves free; the one-token chunks and the long fresh chunk are as without splits."""
    seq_lens, q_lens = [40, 203, *[100 + i for i in range(16)]], [40, 3, *[1] * 16]
    out, ws = _split_prefill(seq_lens, q_lens, 4, skip_decode=False)
    assert torch.isfinite(ws[1][:, 40:43]).all(), "the short chunk's tile is split 4 ways"
    assert torch.isnan(ws[1][:, :40]).all(), "the fresh chunk's tiles ran whole"


def test_paged_prefill_work_list_with_more_items_than_programs():
    """A mixed step of twelve 2-3 token chunks behind 60-200 cached tokens between decode rows: its work list
    (a program per 8-token tile of the step's rows, times the shares: 5 x 4) has 12 x 4 items, so programs take
    several, split 4 ways or run whole."""
    seq_lens = [60 + 13 * i for i in range(12)] + [70] * 5
    q_lens = [2 + i % 2 for i in range(12)] + [1] * 5
    order = [0, 12, 1, 2, 13, 3, 4, 5, 14, 6, 7, 15, 8, 9, 10, 16, 11]  # decode rows between the chunks
    out, ws = _split_prefill([seq_lens[i] for i in order], [q_lens[i] for i in order], 4)
    assert torch.isfinite(ws[1][:, 32:35]).all(), "the last chunk (behind 200 keys) shares its keys 4 ways"
    assert torch.isnan(ws[1][:, :2]).all(), "the first (behind 58) runs whole"


def _split_prefill(
    seq_lens: list[int], q_lens: list[int], splits: int, cap: float | None = None, skip_decode: bool = True
):
    """The prefill kernel over this batch (GQA 4, 8-token query tiles, 16-key tiles, soft cap `cap`) with a split
    workspace of `splits` shares, checked against the oracle and the unsplit kernel (with skip_decode, the rows
    of one-token sequences left alone); returns (out, workspace)."""
    gen = _gen(13)
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.125)
    tiles = dict(skip_decode=skip_decode, block_m=32, block_n=16, soft_cap=cap)
    whole = paged_prefill_attention(*args, out=_nan_like(q), **tiles)
    ws = make_split_workspace(splits, meta.num_tokens + 3, 8, 64, DEVICE)
    ws[0].fill_(float("nan")), ws[1].fill_(float("nan"))
    out = paged_prefill_attention(*args, out=_nan_like(q), split_workspace=ws, min_split_keys=32, **tiles)
    starts = meta.query_start_loc_cpu.tolist()
    rows = [r for i, n in enumerate(q_lens) if n > 1 or not skip_decode for r in range(starts[i], starts[i] + n)]
    decode = [starts[i] for i, n in enumerate(q_lens) if n == 1 and skip_decode]
    want = paged_attention_ref(q.float(), cache.float(), meta, 0.125, soft_cap=cap)
    assert_close(out[rows], want[rows], torch.bfloat16, f"split {splits} vs oracle")
    assert_close(out[rows], whole[rows], torch.bfloat16, f"split {splits} vs whole")
    assert torch.isnan(out[decode]).all(), "decode rows are the decode kernel's"
    assert torch.count_nonzero(ws[2]) == 0, "every merge zeroed its counter"
    return out, ws


# -- attention variants: sliding window, soft-capped logits ------------------------------------------------------

VARIANT_DECODE_CASES = [
    # window, soft cap, partitions, seq_lens: windows shorter than, across and past the sequences, off tile edges
    (8, None, 1, [1, 17, 50]),
    (21, 30.0, 3, [33, 5, 96]),
    (None, 5.0, 2, [40, 9]),
]


@pytest.mark.parametrize("window,cap,parts,seq_lens", VARIANT_DECODE_CASES)
def test_paged_decode_window_and_soft_cap(window, cap, parts, seq_lens):
    gen = _gen(21)
    meta = make_batch(seq_lens, [1] * len(seq_lens), 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = (4 * torch.randn(len(seq_lens), 8, 64, generator=gen)).to(DEVICE, torch.bfloat16)  # scores past the cap
    out = paged_decode_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        0.125,
        out=_nan_like(q),
        num_partitions=parts,
        block_n=16 if not ON_GPU else None,
        sliding_window=window,
        soft_cap=cap,
    )
    want = paged_attention_ref(q.float(), cache.float(), meta, 0.125, sliding_window=window, soft_cap=cap)
    assert_close(out, want, torch.bfloat16, "decode vs torch_ref")
    ref = paged_decode_ref(q.float(), cache, meta.block_tables, meta.seq_lens, 0.125, window, cap)
    assert_close(out, ref, torch.bfloat16, "decode vs paged_decode_ref")
    full = paged_decode_ref(q.float(), cache, meta.block_tables, meta.seq_lens, 0.125)
    assert (ref - full).abs().max() > 0.1, "the variant must change the result (else this test proves nothing)"


VARIANT_PREFILL_CASES = [
    # window, soft cap, seq_lens, q_lens: a window under a query tile (8 tokens) + a key tile, chunks over a prefix
    # that crosses the window edge, a fresh prompt longer than the window, a one-token chunk
    (5, None, [40, 23, 3], [40, 9, 1]),
    (24, 20.0, [70, 31], [17, 31]),
    (None, 8.0, [19, 50], [19, 6]),
]


@pytest.mark.parametrize("window,cap,seq_lens,q_lens", VARIANT_PREFILL_CASES)
def test_paged_prefill_window_and_soft_cap(window, cap, seq_lens, q_lens):
    gen = _gen(22)
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = (4 * torch.randn(meta.num_tokens, 8, 64, generator=gen)).to(DEVICE, torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    tiles = dict(block_m=32, block_n=16) if not ON_GPU else {}
    out = paged_prefill_attention(
        *args, meta.max_query_len, 0.125, out=_nan_like(q), sliding_window=window, soft_cap=cap, **tiles
    )
    want = paged_attention_ref(q.float(), cache.float(), meta, 0.125, sliding_window=window, soft_cap=cap)
    assert_close(out, want, torch.bfloat16, "prefill vs torch_ref")
    ref = paged_prefill_ref(*args, 0.125, window, cap)
    assert_close(out, ref, torch.bfloat16, "prefill vs paged_prefill_ref")
    assert (ref - paged_prefill_ref(*args, 0.125)).abs().max() > 0.1, "the variant must change the result"


# -- the backend -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "prefix"])
def test_triton_backend_matches_torch_backend(kind):
    """Each kind of step against the torch backend; "prefix": a mixed step whose 5-token chunk follows 1,095
    cached tokens, so its query tiles share their keys out (the reserved split workspace)."""
    from heron.attention.triton_backend import TritonAttentionBackend

    gen = _gen(6)
    num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 2, 64, 16, torch.bfloat16
    seq_lens = {"decode": [12, 40, 3], "prefill": [20, 33], "mixed": [25, 7, 40, 1], "prefix": [1100, 25, 1]}[kind]
    q_lens = {"decode": [1, 1, 1], "prefill": [20, 6], "mixed": [1, 7, 11, 1], "prefix": [5, 1, 1]}[kind]
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    t = meta.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    tri = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    tri.num_partitions = 2 if not ON_GPU else None
    tri.reserve(len(seq_lens), DEVICE)
    assert tri.plan(meta) == kind.replace("prefix", "mixed")
    write_kv_ref(k, v, cache, meta.slot_mapping)  # as the model's rotary kernel writes them
    want = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(q.float(), cache.float(), meta)
    tri.prepare(meta)
    lse = tri._split_ws[1].fill_(float("nan"))
    got = tri.forward(q, cache, meta)
    assert_close(got, want, dtype, kind)
    assert lse.isfinite().any() == (kind == "prefix"), "only the long prefix's chunk shares its keys out"


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_triton_backend_takes_each_layers_params(kind):
    """Two layers of one step, one with a window, soft cap and its own scale, one full: each as the torch backend
    computes it with the same params."""
    from heron.attention.backend import AttentionParams
    from heron.attention.triton_backend import TritonAttentionBackend

    gen = _gen(23)
    seq_lens, q_lens = {"decode": ([12, 40, 3], [1, 1, 1]), "mixed": ([25, 7, 40, 1], [1, 7, 11, 1])}[kind]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 2, 64, torch.bfloat16, DEVICE, gen)
    q = (3 * torch.randn(meta.num_tokens, 8, 64, generator=gen)).to(DEVICE, torch.bfloat16)
    tri = TritonAttentionBackend(8, 2, 64, 0.125)
    tri.num_partitions = 2 if not ON_GPU else None
    tri.reserve(len(seq_lens), DEVICE)
    tri.prepare(meta)
    ref = TorchAttentionBackend(8, 2, 64, 0.125)
    for params in (AttentionParams(0.1, sliding_window=6, logits_soft_cap=10.0), None):
        want = ref.forward(q.float(), cache.float(), meta, params)
        assert_close(tri.forward(q, cache, meta, params), want, torch.bfloat16, f"{kind} {params}")


def test_triton_backend_orders_a_decode_step_once(monkeypatch):
    """Every layer of a decode step launches its programs longest first, from one sort per step; mixed steps
    (rows found through query_start_loc) keep grid order."""
    from heron.attention import triton_backend
    from heron.kernels import paged_decode

    sorts, orders = [], []
    monkeypatch.setattr(
        paged_decode, "longest_first", lambda lens: sorts.append(1) or torch.argsort(lens, descending=True)
    )
    real = paged_decode.paged_decode_attention
    monkeypatch.setattr(
        paged_decode,
        "paged_decode_attention",
        lambda *a, order=None, **kw: (
            orders.append(None if order is None else order.tolist()) or real(*a, order=order, **kw)
        ),
    )
    gen = _gen(12)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    tri = triton_backend.TritonAttentionBackend(num_heads, num_kv_heads, head_dim, 0.125)
    tri.num_partitions = 2
    tri.reserve(4, DEVICE)
    steps = []
    for seq_lens, q_lens in (([12, 40, 3], [1, 1, 1]), ([25, 7, 1], [1, 7, 1])):
        meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
        cache = make_cache(meta.num_blocks, 16, num_kv_heads, head_dim, torch.bfloat16, DEVICE, gen)
        q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
        steps.append((q, cache, meta))
        tri.prepare(meta)
        for _ in range(2):  # two layers
            tri.forward(q, cache, meta)
    assert sorts == [1] and orders == [[1, 0, 2], [1, 0, 2], None, None]
    q, cache, meta = steps[0]
    tri.prepare(meta)  # the same step again (as a graph is captured after its eager warm-up): sorted again
    tri.forward(q, cache, meta)
    assert sorts == [1, 1]


# -- CUDA only: production shapes, CUDA graphs ----------------------------------------------------------------


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 16), (128, 32)])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (32, 4)])
def test_paged_decode_large(heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    gen = _gen(7)
    batch = 64
    seq_lens = torch.randint(1, 2049, (batch,), generator=gen).tolist()
    seq_lens[:3] = [1, 2048, 1024]
    meta = make_batch(seq_lens, [1] * batch, block_size, DEVICE, gen)
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, DEVICE, gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = head_dim**-0.5
    ref = paged_decode_ref(q.float(), cache, meta.block_tables, meta.seq_lens, scale)
    for parts in (None, 1, 8):
        out = paged_decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, scale, out=_nan_like(q), num_partitions=parts
        )
        assert_close(out, ref, torch.bfloat16, f"P={parts}")
        ordered = paged_decode_attention(
            q,
            cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            out=_nan_like(q),
            num_partitions=parts,
            order=longest_first(meta.seq_lens),
        )
        assert torch.equal(ordered, out), f"P={parts}: launch order changed the result"
        heads_first = paged_decode_attention(
            q,
            cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            out=_nan_like(q),
            num_partitions=parts,
            order=longest_first(meta.seq_lens),
            heads_first=True,
        )
        assert torch.equal(heads_first, out), f"P={parts}: heads-first launch order changed the result"


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 16), 64), ((32, 4), 128)])
def test_paged_prefill_large(heads, head_dim):
    num_heads, num_kv_heads = heads
    gen = _gen(8)
    seq_lens, q_lens = [1500, 700, 2048, 333, 90], [1500, 200, 512, 1, 90]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, num_kv_heads, head_dim, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale, out=_nan_like(q)
    )
    ref = paged_prefill_ref(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    assert_close(out, ref, torch.bfloat16, "prefill large")


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
def test_paged_prefill_split_keys_large(heads):
    """The prefix workload's mixed step in production shapes: chunks of 90-200 tokens behind ~2,000 cached
    tokens (3-4 shares a tile at the default 512 keys a share), one behind a short prefix, a decode row."""
    num_heads, num_kv_heads = heads
    gen = _gen(9)
    seq_lens, q_lens = [2125, 2300, 2090, 300, 2200], [125, 200, 90, 150, 1]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, num_kv_heads, 128, torch.bfloat16, DEVICE, gen)
    q = torch.randn(meta.num_tokens, num_heads, 128, generator=gen).to(DEVICE, torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 128**-0.5)
    ws = make_split_workspace(4, 1024, num_heads, 128, DEVICE)
    out = paged_prefill_attention(*args, out=_nan_like(q), split_workspace=ws)
    ref = paged_prefill_ref(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 128**-0.5)
    assert_close(out, ref, torch.bfloat16, "split prefill large")
    assert_close(out, paged_prefill_attention(*args), torch.bfloat16, "split vs whole")


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,window,cap", [(256, 4096, 50.0), (256, None, None), (128, 1024, None)])
def test_attention_variants_large(head_dim, window, cap):
    """Gemma 2's shapes (head_dim 256, GQA 2, window 4096, soft cap 50) and a Mistral-like window on long
    sequences: decode (every partition count) and prefill against the references."""
    gen = _gen(24)
    seq_lens, q_lens = [5000, 700, 4097, 333, 90], [1500, 200, 512, 1, 90]
    meta = make_batch(seq_lens, q_lens, 16, DEVICE, gen)
    cache = make_cache(meta.num_blocks, 16, 8, head_dim, torch.bfloat16, DEVICE, gen)
    q = (2 * torch.randn(meta.num_tokens, 16, head_dim, generator=gen)).to(DEVICE, torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    variant = dict(sliding_window=window, soft_cap=cap)
    out = paged_prefill_attention(*args, meta.max_query_len, 0.0625, out=_nan_like(q), **variant)
    assert_close(out, paged_prefill_ref(*args, 0.0625, window, cap), torch.bfloat16, "prefill")
    dq = q[: len(seq_lens)].contiguous()
    ref = paged_decode_ref(dq.float(), cache, meta.block_tables, meta.seq_lens, 0.0625, window, cap)
    for parts in (None, 1, 8):
        out = paged_decode_attention(
            dq, cache, meta.block_tables, meta.seq_lens, 0.0625, out=_nan_like(dq), num_partitions=parts, **variant
        )
        assert_close(out, ref, torch.bfloat16, f"decode P={parts}")


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 96])
def test_decode_step_replays_in_a_cuda_graph(batch):
    """Capture the K/V write (inside the rotary kernel; position 0 rotates nothing) + decode once, then change
    lengths, tables and inputs in place and replay: the result must follow the new values (nothing host-side
    baked in), including a padded (seq_len 0, slot -1) row. Batch 96 (one partition) launches longest first:
    the sort is replayed with the graph."""
    from heron.attention.triton_backend import TritonAttentionBackend
    from heron.kernels.rope import apply_rope_and_cache
    from heron.layers.rotary import RotaryEmbedding

    gen = _gen(9)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    max_len = 1024
    meta = make_batch([max_len] * batch, [1] * batch, block_size, DEVICE, gen)
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, DEVICE, gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn_like(k)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    backend.reserve(batch, DEVICE)
    backend.prepare(meta)
    cos_sin = RotaryEmbedding(head_dim, 16, 1e6, None).cos_sin.to(DEVICE)
    positions = torch.zeros(batch, dtype=torch.int64, device=DEVICE)

    def step():
        return backend.forward(apply_rope_and_cache(q, k, v, positions, cos_sin, cache, meta.slot_mapping), cache, meta)

    step()  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for step in range(3):
        new_lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
        new_lens[-1] = 0  # a padded entry
        new = make_batch(
            new_lens.tolist(),
            [1] * (batch - 1) + [0],
            block_size,
            DEVICE,
            gen,
            extra_blocks=meta.num_blocks - sum(-(-n // block_size) for n in new_lens.tolist()),
        )
        meta.seq_lens.copy_(new.seq_lens)
        meta.block_tables.zero_()
        meta.block_tables[:, : new.block_tables.shape[1]].copy_(new.block_tables)
        slots = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
        slots[: batch - 1] = new.slot_mapping
        meta.slot_mapping.copy_(slots)
        q.copy_(torch.randn(q.shape, generator=gen))
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        before = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_cache = before
        write_kv_ref(k, v, want_cache, meta.slot_mapping)
        assert torch.equal(cache, want_cache)
        ref = paged_decode_ref(q.float(), cache, meta.block_tables, meta.seq_lens, head_dim**-0.5)
        assert_close(out, ref, torch.bfloat16, f"replay {step}")


def _pad_to_graph(meta, tokens: int) -> None:
    """`meta` (from make_batch, its padded sequences already there with no keys and no tokens) grown to a
    prefill graph's counts as the runner pads it: `tokens` rows, the rows past its own writing nothing."""
    pad = torch.full((tokens - meta.num_tokens,), -1, dtype=torch.int64, device=meta.slot_mapping.device)
    meta.slot_mapping = torch.cat([meta.slot_mapping, pad])
    meta.num_tokens, meta.max_query_len, meta.cuda_graph = tokens, tokens, True


def test_triton_backend_plans_graph_steps():
    """A captured prefill graph replays any mix of rows: always both kernels. Decode graphs stay decode."""
    from heron.attention.triton_backend import TritonAttentionBackend

    gen = _gen(10)
    prefill = make_batch([20, 9], [20, 3], 16, DEVICE, gen)
    decode = make_batch([12, 40], [1, 1], 16, DEVICE, gen)
    assert TritonAttentionBackend.plan(prefill) == "prefill"
    _pad_to_graph(prefill, 32)
    assert TritonAttentionBackend.plan(prefill) == "mixed"
    decode.cuda_graph = True
    assert TritonAttentionBackend.plan(decode) == "decode"


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_triton_backend_runs_a_padded_graph_batch(kind):
    """A step padded to a prefill graph's (tokens, sequences): the real rows as the torch backend gives them,
    padded sequences skipped by both kernels, and the rows past the step's tokens zeros (not garbage)."""
    from heron.attention.triton_backend import TritonAttentionBackend

    gen = _gen(11)
    num_heads, num_kv_heads, head_dim, block_size, dtype = 8, 2, 64, 16, torch.bfloat16
    seq_lens = {"prefill": [20, 0, 0, 0], "mixed": [25, 30, 9, 0, 0]}[kind]
    q_lens = {"prefill": [20, 0, 0, 0], "mixed": [1, 7, 9, 0, 0]}[kind]
    meta = make_batch(seq_lens, q_lens, block_size, DEVICE, gen)
    n, tokens = meta.num_tokens, 32
    cache = make_cache(meta.num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE, gen)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    write_kv_ref(k, v, cache, meta.slot_mapping)
    scale = head_dim**-0.5
    want = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(q[:n].float(), cache.float(), meta)
    _pad_to_graph(meta, tokens)
    tri = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    tri.num_partitions = 2 if not ON_GPU else None
    tri.reserve(len(seq_lens), DEVICE)
    tri.prepare(meta)
    got = tri.forward(q, cache, meta)
    assert_close(got[:n], want, dtype, kind)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))
