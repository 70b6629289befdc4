"""Paged decode attention (one query token per sequence), split-KV ("flash-decoding").

Kernel 1, grid (B, Hkv, P): program (b, h, p) takes the G = H / Hkv query heads that share KV head h as the
rows of one [G_PAD, D] tile (G_PAD = max(16, next_pow2(G)): tl.dot needs M >= 16; pad rows are zero and
never stored), and folds partition p of sequence b's keys into an online softmax, BLOCK_N keys at a time,
gathered from the paged cache through the block table. Each KV byte is read once for all G heads.
Partition p covers tiles [p * tpp, (p + 1) * tpp) of the sequence's ceil(seq_len / BLOCK_N) tiles, with
tpp = ceil(num_tiles / P) computed on the device from seq_lens: long and short sequences are both split
P ways, and partitions past a short sequence's end return at once.

With P > 1 the partitions of (b, h) combine their partial results (normalised output, running max, running
sum; log-sum-exp rescaling) in the same launch: each stores its partials and bumps the pair's arrival counter
(an acq_rel atomic after a CTA barrier, which publishes the CTA's stores), and the partition that arrives last
sums them in partition order, stores the output and resets the counter to zero for the next call. Empty
partitions arrive too. One launch instead of a second reduce kernel: at batch 1 that kernel cost as much as
its launch and the gap after it (~2.5 us a layer); and the result is deterministic (a fixed order).

The grid depends only on (B, Hkv, P): nothing host-side that changes per step, so the step can be captured in
a CUDA graph with P fixed for the captured batch size; the counters are left zeroed by every call.

Launch order: the GPU starts programs in grid order, and a program's work is its sequence's length, so a long
sequence started last runs on while the other SMs idle. With `order` (`longest_first(seq_lens)`, computed on the
device once a step) grid row i takes sequence order[i]: within each KV head's row of programs the longest go
first and the last programs to start are short ones. With `heads_first` the grid is (Hkv, B, P): the KV heads
of one sequence start together (they read the same blocks, whose rows interleave the heads) and, with `order`,
every (sequence, head) program runs in order of length, not once per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attn_tile import LOG2E, attend_tile, dot_precision, merge_prefix, tile_blocks
from heron.kernels.common import check_cache, dot_upcast, num_sms, pdl_enter, pdl_options
from heron.kernels.reference import is_fp8


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    order_ptr,
    kv_start_ptr,
    prefix_o_ptr,
    prefix_lse_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    count_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cblk,
    stride_coff,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    USE_QSL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    PREFIX_PARTS: tl.constexpr,
    LO_MASK: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    if HEADS_FIRST:
        b = tl.program_id(1)
        kvh = tl.program_id(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(order_ptr + b).to(tl.int32)
    part = tl.program_id(2)
    if USE_QSL:
        # Mixed batch: this sequence's one query row is at query_start_loc[b]; sequences with more than one
        # query token belong to the prefill kernel.
        row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return
    else:
        row = b
    row = row.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    if LO_MASK:  # the partitions split the tiles of the keys [kv_lo, seq_len)
        if WINDOW:
            kv_lo = tl.maximum(seq_len - WINDOW, 0)
        else:  # cascade: keys before kv_start are the shared prefix's (heron/kernels/cascade.py)
            kv_lo = tl.load(kv_start_ptr + b)
        tile_lo = kv_lo // BLOCK_N
        tiles_per_part = tl.cdiv(num_tiles - tile_lo, NUM_PARTS)
        t_begin = tile_lo + part * tiles_per_part
    else:
        kv_lo = 0
        tiles_per_part = tl.cdiv(num_tiles, NUM_PARTS)
        t_begin = part * tiles_per_part
    t_end = tl.minimum(t_begin + tiles_per_part, num_tiles)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < G
    heads = kvh * G + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    for t in range(t_begin, t_end):  # the kernel's num_stages pipelines the K/V loads (they feed dots)
        blk = tile_blocks(bt_row, t * BLOCK_N, kv_lo, seq_len, BLOCK_SIZE, BLOCK_N, LO_MASK)
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_cache_ptr,
            v_cache_ptr,
            blk,
            kv_head_off,
            t * BLOCK_N,
            kv_lo,
            seq_len,
            stride_cblk,
            stride_coff,
            qk_scale,
            v_scale,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            UPCAST,
            PRECISION,
            LO_MASK,
            SOFT_CAP,
            FP8,
        )

    out_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if NUM_PARTS == 1:
        if PREFIX_PARTS:
            acc, l_i = merge_prefix(
                acc,
                m_i,
                l_i,
                prefix_o_ptr,
                prefix_lse_ptr,
                b,
                heads,
                g_ok,
                kv_lo > 0,
                NUM_HEADS,
                HEAD_DIM,
                PREFIX_PARTS,
            )
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padded row): zeros
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # Partials are [B, H, P, (D)] float32; l_i >= 1 in a partition that is not empty.
        base = (b * NUM_HEADS + heads) * NUM_PARTS  # [G_PAD]: partition 0 of each head
        wrote = g_ok & (t_begin < t_end)
        tl.store(part_o_ptr + (base + part)[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=wrote[:, None])
        tl.store(part_m_ptr + base + part, m_i, mask=wrote)
        tl.store(part_l_ptr + base + part, l_i, mask=wrote)
        tl.debug_barrier()  # every thread's partials are issued before the release below
        count = count_ptr + b * NUM_KV_HEADS + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_PARTS - 1:
            # The last to arrive: the partitions holding keys are the first ceil(num_tiles / tiles_per_part)
            # (of the window's tiles, with WINDOW).
            if LO_MASK:
                num_valid = tl.cdiv(num_tiles - tile_lo, tl.maximum(tiles_per_part, 1))
            else:
                num_valid = tl.cdiv(num_tiles, tl.maximum(tiles_per_part, 1))
            p = tl.arange(0, PARTS_PAD)
            m_all = tl.load(
                part_m_ptr + base[:, None] + p[None, :],
                mask=g_ok[:, None] & (p < num_valid)[None, :],
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m_max = tl.max(m_all, 1)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no keys (a padded row): zeros below
            acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
            denom = tl.zeros([G_PAD], tl.float32)
            for s in range(0, num_valid):  # in partition order: the same sum whichever partition arrived last
                m_s = tl.load(part_m_ptr + base + s, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(part_l_ptr + base + s, mask=g_ok, other=0.0, cache_modifier=".cg")
                w = l_s * tl.exp2(m_s - m_max)
                o_s = tl.load(
                    part_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=g_ok[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                acc += o_s * w[:, None]
                denom += w
            if PREFIX_PARTS:
                acc, denom = merge_prefix(
                    acc,
                    m_max,
                    denom,
                    prefix_o_ptr,
                    prefix_lse_ptr,
                    b,
                    heads,
                    g_ok,
                    kv_lo > 0,
                    NUM_HEADS,
                    HEAD_DIM,
                    PREFIX_PARTS,
                )
            out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
            tl.store(count, 0)


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The sequences by descending length ([B] int64): `order` for paged_decode_attention. One small sort on the
    device (no sync), shared by every layer of a step."""
    return torch.argsort(seq_lens, descending=True)


def default_num_partitions(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """KV partitions per sequence: enough (batch_size * num_kv_heads * P) programs for about four per SM,
    a power of two in [1, 16]. A function of the batch size and the model only, so one captured graph per
    batch size keeps one value."""
    want = triton.cdiv(4 * num_sms(device), max(1, batch_size * num_kv_heads))
    return min(16, triton.next_power_of_2(max(1, want)))


def default_block_n(block_size: int, num_partitions: int, elem_size: int, head_dim: int, cascade: bool = False) -> int:
    """Keys per tile: 128 for a 16-bit cache when each program has a long run of keys (at most two partitions:
    batch x KV heads fill the GPU, no cascade: after a shared prefix a sequence's own keys are a few hundred,
    a tile or three, and 128-key tiles' three stages take 192 KB of shared memory, one program an SM), else
    64; 32 at head_dim 256 (Gemma). Swept on an H200
    (docs/history/perf_notes.md run 20): 128 keys with 3 stages took batch 100 (~1,200-token contexts) from 140
    to 127 us, batch 200 177 -> 172, the
    `kernels` case (batch 64, P 2) 105.5 -> 103. A float32 cache keeps 64 keys: 128 would take ~148 KB of shared
    memory at D 128 (sm_90 build), more than GPUs with ~100 KB per SM have. At D 256, 32 keys: not yet timed
    (neither 32 nor 64 spills in the sm_90 build). The block size is a floor."""
    if head_dim > 128:
        return max(32, block_size)
    return max(128 if num_partitions <= 2 and elem_size <= 2 and not cascade else 64, block_size)


DecodeWorkspace = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_decode_workspace(
    batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, num_partitions: int, device: torch.device
) -> DecodeWorkspace:
    """Split-KV decode's float32 partials (out [B, H, P, D], max [B, H, P], sum [B, H, P]) and zeroed int32
    arrival counters [B, Hkv]. Allocate once (per batch size) and pass it in: a captured graph then keeps
    fixed addresses."""
    part_o = torch.empty(batch_size, num_heads, num_partitions, head_dim, dtype=torch.float32, device=device)
    part_m = torch.empty(batch_size, num_heads, num_partitions, dtype=torch.float32, device=device)
    part_l = torch.empty(batch_size, num_heads, num_partitions, dtype=torch.float32, device=device)
    return part_o, part_m, part_l, torch.zeros(batch_size, num_kv_heads, dtype=torch.int32, device=device)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_partitions: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    order: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    heads_first: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_start: torch.Tensor | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention over the paged cache.

    q [B, H, D] (one query per sequence, row b is sequence b), or, with `query_start_loc` [B + 1] int32,
    q [T, H, D] of a mixed batch: sequence b's row is query_start_loc[b] and sequences whose query length is
    not 1 are skipped (their output rows are left untouched). kv_cache [2, num_blocks, block_size, Hkv, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (keys per sequence, the query's own included;
    0 gives zeros). `workspace`: `make_decode_workspace`'s, for P > 1 (else one is allocated). `order`: a
    permutation of the B sequences ([B] int), the launch order (`longest_first`); `heads_first`: the KV heads
    innermost in the grid. Neither changes the result. `sliding_window` W: each query sees its last W keys only;
    `soft_cap` c: scores s become c * tanh(s / c) (each a compiled variant of its own; None: full attention).
    Cascade (heron/kernels/cascade.py): with `kv_start` [B] int32 and `prefix` (out [B, H, PP, D], lse
    [B, H, PP] float32, `cascade_prefix_attention`'s), sequence b attends to keys [kv_start[b], seq_len) only and
    merges the prefix's partials over keys [0, kv_start[b]) where kv_start[b] > 0. A float8 (e4m3) cache is read
    as k * k_scale and v * v_scale.
    Returns `out` (allocated like q if None). No host-device sync; the grid is (B, Hkv, P) or (Hkv, B, P).
    """
    check_cache(kv_cache)
    fp8 = is_fp8(kv_cache.dtype)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch = seq_lens.shape[0]
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1, "q needs a contiguous head_dim"
    assert block_tables.shape[0] >= batch and block_tables.stride(-1) == 1
    if query_start_loc is None:
        assert q.shape[0] >= batch, "q needs one row per sequence"
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_partitions is None:
        num_partitions = default_num_partitions(batch, num_kv_heads, q.device)
    elem_size, cascade = kv_cache.element_size(), prefix is not None
    block_n = block_n or default_block_n(block_size, num_partitions, elem_size, head_dim, cascade)
    if num_partitions > 1:
        if workspace is None:
            workspace = make_decode_workspace(batch, num_heads, num_kv_heads, head_dim, num_partitions, q.device)
        part_o, part_m, part_l, counts = workspace
        assert part_o.shape[0] >= batch and part_o.shape[1:] == (num_heads, num_partitions, head_dim)
        assert part_o.is_contiguous() and part_m.is_contiguous() and part_l.is_contiguous()
        assert counts.dtype == torch.int32 and counts.numel() >= batch * num_kv_heads and counts.is_contiguous()
    else:
        part_o = part_m = part_l = counts = out  # unused
    assert order is None or order.shape[0] >= batch
    if prefix is not None:
        assert kv_start is not None and not sliding_window, "a cascade takes kv_start and no sliding window"
        prefix_o, prefix_lse = prefix
        prefix_parts = prefix_lse.shape[-1]
        assert prefix_o.shape[1:] == (num_heads, prefix_parts, head_dim) and prefix_o.shape[0] >= batch
        assert prefix_o.is_contiguous() and prefix_lse.is_contiguous()
    else:
        kv_start = prefix_o = prefix_lse = seq_lens  # placeholder pointers when unused
        prefix_parts = 0
    use_qsl = query_start_loc is not None
    qsl = query_start_loc if use_qsl else seq_lens  # placeholder pointers when unused
    rows = order if order is not None else seq_lens
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_kv_heads, batch, num_partitions) if heads_first else (batch, num_kv_heads, num_partitions)
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        qsl,
        rows,
        kv_start,
        prefix_o,
        prefix_lse,
        out,
        part_o,
        part_m,
        part_l,
        counts,
        scale * LOG2E * (k_scale if fp8 else 1.0),
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_PARTS=num_partitions,
        PARTS_PAD=triton.next_power_of_2(num_partitions),
        USE_QSL=use_qsl,
        UPCAST=dot_upcast(),
        PRECISION=dot_precision(q.dtype),
        HAS_ORDER=order is not None,
        HEADS_FIRST=heads_first,
        WINDOW=sliding_window or 0,
        SOFT_CAP=soft_cap * LOG2E if soft_cap else 0.0,
        PREFIX_PARTS=prefix_parts,
        LO_MASK=bool(sliding_window) or prefix_parts > 0,
        FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages or (3 if block_n >= 128 and elem_size <= 2 else 2),
        **pdl_options(q.device, q.shape[0]),
    )
    return out
