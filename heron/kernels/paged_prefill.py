"""Paged prefill / extend attention: variable-length query chunks over each sequence's cached prefix plus the
new tokens (already written to the cache), causal, GQA, K/V read through the block tables.

Grid (ceil(max_query_len / BLOCK_Q), B, Hkv). Program (i, b, h) takes BLOCK_Q = BLOCK_M / G_PAD query tokens
of sequence b (tile i of its chunk) times the G query heads of KV head h (G_PAD = next_pow2(G)) as the
BLOCK_M rows of one tile; row r is token r // G_PAD, head r % G_PAD. So each K/V tile gathered from the
cache serves all G heads: G times less K/V traffic than one program per query head. Query t of sequence b
sits at position ctx + t, ctx = seq_len - q_len. Key tiles wholly at or before the tile's first query
position are visible to every row and go through an unmasked loop; the few tiles on the diagonal go through
a masked one; tiles past the tile's last query position are never visited. Programs whose query tile lies
past their sequence's chunk (the grid is sized by the longest chunk) return at once.

Work list (`skip_decode`, a mixed step's prompt chunks beside decode rows, which the decode kernel does): the
grid is (P, 1, Hkv) instead, and each program of a KV head takes every P-th item of the step's work, which it
lists itself from query_start_loc (a cumulative sum over the B sequences' item counts, WORK_LIST_SEQS at a time):
the query tiles of the chunks of two tokens or more, each in `splits` share slots. P fits the tiles of q's rows
(the step's tokens, or its graph's). A replayed mixed graph of 256 sequence slots and 896 token rows thus
launches a few hundred programs where the (tile rows, B, Hkv) grid launched ~28,000, nearly all of them decode
rows' that exit at once but still take their turn on an SM.

`max_query_len` is a host int (AttentionMetadata has it): no device read-back.

Split keys (a `split_workspace` for S shares): a step of a few short chunks over long cached prefixes (a
request joining 255 decoding ones behind a 2,000-token system prompt) has only a few query tiles, each walking
~60 key tiles in turn on one SM while the rest idle. Then up to S programs share a query tile's unmasked key
tiles (one per `min_split_keys` keys), the last of them also the diagonal; each stores its normalized partial
output and log-sum-exp and bumps the tile's arrival counter, and the share that arrives last merges them
(`_merge_shares`, in share order) and zeroes the counter: no second launch. The shares run in the grid's
first-axis slots: slot i of a chunk of n query tiles is share i // n of tile i % n. A wide prefill step (more
than SPLIT_SLOTS_MAX_SEQS sequences) keeps its grid, and its shorter chunks use the slots they leave free; a
narrower one, and each tile of a work list, gets S slots a tile. How many share a tile is computed on the
device from the step's data (`_num_splits`, the slots), so a CUDA graph replays any step, and a tile with a
short prefix runs whole and writes its output itself (the programs of its other slots return at once).

With a sliding window (WINDOW, a constexpr: 0 compiles the variant above) row r sees keys (pos_r - WINDOW,
pos_r]: tiles wholly before the tile's first row's window are never visited, the keys every row sees (from the
last row's window start to the first row's position) go through the unmasked loop, and the tiles at the
window's lower edge through the masked one, which then also tolerates a row that has seen no key yet.
SOFT_CAP (Gemma 2's capped scores, see attn_tile.py) is the other constexpr switch.

The key loop (`_attend_keys`) reads each tile's block-table entries one iteration ahead, so the K/V gathers
never wait on a table read and the software pipeline spends its stages on K/V buffers; the online softmax
scales inside the exponent's argument (`_softmax_pv`: one FMA per score). With 8 warps the kernel is held to
128 registers, two programs per SM, so one program's softmax overlaps the other's matrix products. Against
the previous loop (table read in the same iteration, scale then subtract, 2 stages): 1.09-1.10 x on the
kernels benchmark's prefill, 1.06-1.09 x on fresh 512-token prompts (H200, docs/history/perf_notes.md run 14; a
lazy rescale of the accumulator and a longest-first launch order were slower there).

Length: one kernel (its two grids: per sequence, or a work list), its key-split merge and their host side; the
loops, the online softmax and the tile's code are shared (the two grids call `_prefill_tile` each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attn_tile import LOG2E, dot_precision, fp8_kv, soft_cap
from heron.kernels.common import check_cache, dot_upcast, num_sms, pdl_enter, pdl_options
from heron.kernels.reference import is_fp8


@triton.jit
def _kv_rows(
    bt_row_ptr, n0, kv_len, kv_head_off, stride_cblk, stride_coff, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """int64 cache offsets of keys n0 .. n0 + BLOCK_N - 1 of one KV head: token n sits in block
    bt_row[n // BLOCK_SIZE] at offset n % BLOCK_SIZE. Keys >= kv_len read no table entry (block 0 stands in)."""
    n = n0 + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n < kv_len, other=0).to(tl.int64)
    return blk * stride_cblk + (n % BLOCK_SIZE) * stride_coff + kv_head_off


@triton.jit
def _load_rows(
    cache_ptr,
    rows,
    n0,
    kv_len,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The [BLOCK_N, HEAD_DIM] K or V tile at `rows` (zeros for keys >= kv_len when MASK_LEN)."""
    off = rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    if MASK_LEN:
        x = tl.load(cache_ptr + off, mask=(n0 + tl.arange(0, BLOCK_N) < kv_len)[:, None], other=0.0)
    else:
        x = tl.load(cache_ptr + off)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _softmax_pv(
    acc,
    m_i,
    l_i,
    s,
    v,
    n0,
    kv_len,
    pos,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Fold the raw scores s = q k^T [M, BLOCK_N] of keys n0.. and their values v into the online softmax
    (log2 domain: qk_scale = softmax scale * log2 e; p = exp2(s * qk_scale - m), one FMA per score). MASKED:
    row r sees keys n <= pos[r] and n < kv_len (and n > pos[r] - WINDOW). Without a window every row has seen an
    unmasked key before or in this tile (callers guarantee it), so the running max is finite; with one a row
    may not have yet, and its max stays -inf with nothing added."""
    if SOFT_CAP > 0:
        s = soft_cap(s * qk_scale, SOFT_CAP)
    if MASKED:
        n = n0 + tl.arange(0, BLOCK_N)
        seen = (n[None, :] <= pos[:, None]) & (n < kv_len)[None, :]
        if WINDOW:
            seen = seen & (n[None, :] > pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
    if SOFT_CAP > 0:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_sub = m_new
    if WINDOW:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: alpha and p are 0, not NaN
    alpha = tl.exp2(m_i - m_sub)
    if SOFT_CAP > 0:
        p = tl.exp2(s - m_sub[:, None])
    else:
        p = tl.exp2(s * qk_scale - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head_off,
    lo,
    hi,
    pos,
    stride_cblk,
    stride_coff,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr,
):
    """Fold keys lo .. hi - 1 (lo a multiple of BLOCK_N) into the accumulator, BLOCK_N at a time. MASKED: the
    tiles on the diagonal or the window's edge (causal and window mask, keys >= hi masked); else every key is
    seen by every row and hi is a multiple of BLOCK_N. The next tile's cache rows are computed one iteration
    ahead (a loop-carried tile). FP8: a float8 cache, unscaled here (the kernel folds k_scale into qk_scale and
    v_scale into its output)."""
    rows = _kv_rows(bt_row, lo, hi, kv_head_off, stride_cblk, stride_coff, BLOCK_SIZE, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        rows_next = _kv_rows(bt_row, n0 + BLOCK_N, hi, kv_head_off, stride_cblk, stride_coff, BLOCK_SIZE, BLOCK_N)
        k = _load_rows(k_cache_ptr, rows, n0, hi, HEAD_DIM, BLOCK_N, MASKED, UPCAST)
        v = _load_rows(v_cache_ptr, rows, n0, hi, HEAD_DIM, BLOCK_N, MASKED, UPCAST)
        if FP8:
            k, v = fp8_kv(k, v, q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        acc, m_i, l_i = _softmax_pv(
            acc, m_i, l_i, s, v, n0, hi, pos, qk_scale, BLOCK_N, MASKED, PRECISION, WINDOW, SOFT_CAP
        )
        rows = rows_next
    return acc, m_i, l_i


@triton.jit
def _num_splits(first_pos, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """How many programs share a query tile's unmasked key tiles (those before its first position): one per
    MIN_TILES of them, at most SPLITS. The prefill kernel and the merge compute it alike, from the same data."""
    return tl.minimum(tl.maximum((first_pos + 1) // BLOCK_N // MIN_TILES, 1), SPLITS)


@triton.jit
def _prefill_tile(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    count_ptr,
    ws_rows,
    num_heads,
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
    b,
    kvh,
    q_start,
    q_len,
    qt,
    split,
    used,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Query tile qt of sequence b (its chunk: q_len rows from q_start) times KV head kvh's G query heads: share
    `split` of the `used` (`_tile_shares`) that spread its unmasked keys, the whole tile where used is 1."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    tok = qt * BLOCK_Q + r // G_PAD
    g = r % G_PAD
    r_ok = (tok < q_len) & (g < G)
    pos = ctx + tok
    q_row = (q_start + tok).to(tl.int64)
    heads = kvh * G + g
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=r_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch

    first_pos = ctx + qt * BLOCK_Q  # the tile's first query position: keys <= it are seen by every row
    kv_end = ctx + tl.minimum(q_len, (qt + 1) * BLOCK_Q)  # one past the tile's last query position
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    if WINDOW:
        # Keys before `lo` lie outside every row's window; keys from the last row's window start on (rounded
        # up to a tile: `mid`) up to the first row's position are in all of them.
        lo = tl.maximum(first_pos + 1 - WINDOW, 0) // BLOCK_N * BLOCK_N
        mid = tl.minimum(tl.cdiv(tl.maximum(kv_end - WINDOW, 0), BLOCK_N) * BLOCK_N, full_end)
        acc, m_i, l_i = _attend_keys(
            acc,
            m_i,
            l_i,
            q,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head_off,
            lo,
            mid,
            pos,
            stride_cblk,
            stride_coff,
            qk_scale,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            UPCAST,
            PRECISION,
            WINDOW,
            SOFT_CAP,
            FP8,
        )
    else:
        mid = 0
    hi = full_end
    if SPLITS > 1:  # this program's share of the unmasked tiles; the last share takes the diagonal too
        n_tiles = full_end // BLOCK_N
        mid = split * n_tiles // used * BLOCK_N
        hi = (split + 1) * n_tiles // used * BLOCK_N
        kv_end = tl.where(split == used - 1, kv_end, full_end)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head_off,
        mid,
        hi,
        pos,
        stride_cblk,
        stride_coff,
        qk_scale,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        UPCAST,
        PRECISION,
        WINDOW,
        SOFT_CAP,
        FP8,
    )
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head_off,
        full_end,
        kv_end,
        pos,
        stride_cblk,
        stride_coff,
        qk_scale,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        UPCAST,
        PRECISION,
        WINDOW,
        SOFT_CAP,
        FP8,
    )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8:
        out = out * v_scale
    out_ptrs = out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if used > 1:  # a partial result and its log-sum-exp (log2); the share that arrives last merges them all
        rows = (split * ws_rows + q_row) * num_heads + heads
        tl.store(part_o_ptr + rows[:, None] * HEAD_DIM + d[None, :], out, mask=r_ok[:, None])
        tl.store(part_lse_ptr + rows, m_i + tl.log2(l_safe), mask=r_ok)
        tl.debug_barrier()  # every thread's partials are issued before the release below
        count = count_ptr + (q_start + qt * BLOCK_Q) * num_heads + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == used - 1:
            out = _merge_shares(
                part_o_ptr, part_lse_ptr, ws_rows, num_heads, q_row, heads, r_ok, used, HEAD_DIM, SPLITS
            )
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
            tl.store(count, 0)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


@triton.jit
def _tile_shares(
    seq_lens_ptr,
    b,
    q_len,
    qt,
    slots,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """How many of its `slots` programs share tile qt of sequence b's chunk (`_num_splits` of its first query
    position; 1 without SPLITS). The programs in the slots past them have nothing to do."""
    if SPLITS > 1:
        first_pos = tl.load(seq_lens_ptr + b) - q_len + qt * BLOCK_Q
        return tl.minimum(_num_splits(first_pos, BLOCK_N, SPLITS, MIN_TILES), slots)
    else:
        return 1


@triton.jit
def _work_items(qsl_ptr, c, batch, BLOCK_B: tl.constexpr, BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr):
    """The work items of sequences c .. c + BLOCK_B - 1: SPLITS a query tile for a chunk of two tokens or more,
    none for a decode row (the decode kernel's) or a sequence past the batch."""
    seq = c + tl.arange(0, BLOCK_B)
    starts = tl.load(qsl_ptr + seq, mask=seq < batch, other=0)
    lens = tl.load(qsl_ptr + seq + 1, mask=seq < batch, other=0) - starts
    return tl.where(lens > 1, tl.cdiv(lens, BLOCK_Q) * SPLITS, 0)


@triton.jit(do_not_specialize=["batch"])  # one binary for any sequence count (else a new count compiled mid-job)
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    count_ptr,
    batch,
    ws_rows,
    num_heads,
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
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORK_LIST: tl.constexpr,
    BLOCK_B: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr,
    SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    kvh = tl.program_id(2)
    if WORK_LIST:
        # The step's work items, SPLITS a query tile of each chunk of two tokens or more, in sequence order;
        # program p of a KV head takes items p, p + P, ... (P programs: the grid's first axis).
        total = 0
        for c in range(0, batch, BLOCK_B):
            total += tl.sum(_work_items(qsl_ptr, c, batch, BLOCK_B, BLOCK_Q, SPLITS))
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            # its sequence b: the first whose items end past it; `first`, the items of those before b
            b = 0
            first = 0
            done = 0
            for c in range(0, batch, BLOCK_B):
                items = _work_items(qsl_ptr, c, batch, BLOCK_B, BLOCK_Q, SPLITS)
                before = tl.cumsum(items, 0) + done <= item
                b += tl.sum(before.to(tl.int32))
                first += tl.sum(tl.where(before, items, 0))
                done += tl.sum(items)
            q_start = tl.load(qsl_ptr + b)
            q_len = tl.load(qsl_ptr + b + 1) - q_start
            n = tl.cdiv(q_len, BLOCK_Q)
            qt = (item - first) % n
            split = (item - first) // n
            used = _tile_shares(seq_lens_ptr, b, q_len, qt, SPLITS, BLOCK_Q, BLOCK_N, SPLITS, MIN_TILES)
            if split < used:
                _prefill_tile(
                    q_ptr,
                    k_cache_ptr,
                    v_cache_ptr,
                    bt_ptr,
                    seq_lens_ptr,
                    out_ptr,
                    part_o_ptr,
                    part_lse_ptr,
                    count_ptr,
                    ws_rows,
                    num_heads,
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
                    b,
                    kvh,
                    q_start,
                    q_len,
                    qt,
                    split,
                    used,
                    G,
                    G_PAD,
                    HEAD_DIM,
                    BLOCK_SIZE,
                    BLOCK_M,
                    BLOCK_N,
                    UPCAST,
                    PRECISION,
                    WINDOW,
                    SOFT_CAP,
                    FP8,
                    SPLITS,
                )
    else:
        qt = tl.program_id(0)
        b = tl.program_id(1)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        split = 0
        slots = 1
        if SPLITS > 1:  # slot qt of the grid's first axis is share qt // n of the chunk's tile qt % n
            n = tl.maximum(tl.cdiv(q_len, BLOCK_Q), 1)
            split = qt // n
            qt = qt % n
            slots = tl.num_programs(0) // n
        if qt * BLOCK_Q >= q_len:
            return
        used = _tile_shares(seq_lens_ptr, b, q_len, qt, slots, BLOCK_Q, BLOCK_N, SPLITS, MIN_TILES)
        if split >= used:
            return
        _prefill_tile(
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            bt_ptr,
            seq_lens_ptr,
            out_ptr,
            part_o_ptr,
            part_lse_ptr,
            count_ptr,
            ws_rows,
            num_heads,
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
            b,
            kvh,
            q_start,
            q_len,
            qt,
            split,
            used,
            G,
            G_PAD,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            UPCAST,
            PRECISION,
            WINDOW,
            SOFT_CAP,
            FP8,
            SPLITS,
        )


@triton.jit
def _merge_shares(
    part_o_ptr, part_lse_ptr, ws_rows, num_heads, q_row, heads, r_ok, used, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr
):
    """A split tile's output: its `used` shares' partial outputs weighted by exp2(lse - max lse), over the sum of
    the weights, summed in share order (the same result whichever share arrived last). Read past L1 (.cg): the
    other shares wrote them from other SMs."""
    d = tl.arange(0, HEAD_DIM)
    m = tl.full(q_row.shape, float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        ok = r_ok & (s < used)
        lse = tl.load(
            part_lse_ptr + (s * ws_rows + q_row) * num_heads + heads, mask=ok, other=float("-inf"), cache_modifier=".cg"
        )
        m = tl.maximum(m, lse)
    m = tl.where(r_ok, m, 0.0)
    acc = tl.zeros([q_row.shape[0], HEAD_DIM], tl.float32)
    den = tl.zeros(q_row.shape, tl.float32)
    for s in tl.static_range(SPLITS):
        ok = r_ok & (s < used)
        rows = (s * ws_rows + q_row) * num_heads + heads
        lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(ok, tl.exp2(lse - m), 0.0)
        o = tl.load(
            part_o_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg"
        )
        acc += w[:, None] * o
        den += w
    return acc / tl.where(den > 0, den, 1.0)[:, None]


WORK_LIST_SEQS = 256  # the sequences a work list's programs scan at a time (a constant: one compiled variant)
SPLIT_SLOTS_MAX_SEQS = 16  # steps of at most this many sequences get `splits` grid slots per query tile
SplitWorkspace = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # partial outputs, log-sum-exps, counters


def make_split_workspace(splits: int, rows: int, num_heads: int, head_dim: int, device: torch.device) -> SplitWorkspace:
    """For a step of up to `rows` query tokens whose tiles may share their keys out `splits` ways: the partial
    outputs [splits, rows, H, D] and log-sum-exps [splits, rows, H] (float32), and the arrival counters [rows, H]
    (int32, zero; each merge leaves its counter zeroed). Allocate once: a captured graph keeps the addresses."""
    return (
        torch.empty(splits, rows, num_heads, head_dim, dtype=torch.float32, device=device),
        torch.empty(splits, rows, num_heads, dtype=torch.float32, device=device),
        torch.zeros(rows, num_heads, dtype=torch.int32, device=device),
    )


def default_prefill_config(head_dim: int, group: int, device: torch.device) -> dict:
    """Tile sizes and launch options. BLOCK_M rows = (query tokens) x (padded GQA group)."""
    g_pad = triton.next_power_of_2(group)
    if device.type != "cuda":  # the interpreter: small tiles are faster there
        return dict(block_m=max(16, g_pad), block_n=16, num_warps=4, num_stages=1, maxnreg=None)
    if head_dim > 128:  # D 256 (Gemma): not yet timed (no 64- or 128-row tile spills in the sm_90 build)
        return dict(block_m=max(64, g_pad), block_n=16, num_warps=8, num_stages=2, maxnreg=None)
    # From sweeps on an H200 (bf16; docs/kernels.md, docs/history/perf_notes.md run 14): D 128 -> 128 x 32 tiles,
    # 8 warps, 3 stages, 128 registers (two programs per SM); D 64 -> 64 x 64, 4 warps (~260-300 TFLOP/s).
    if head_dim >= 128:
        return dict(block_m=max(128, g_pad), block_n=32, num_warps=8, num_stages=3, maxnreg=128)
    return dict(block_m=max(64, g_pad), block_n=64, num_warps=4, num_stages=2, maxnreg=None)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    skip_decode: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_workspace: SplitWorkspace | None = None,
    min_split_keys: int = 512,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys.

    q [T, H, D]; sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1] and sit at the last
    q_len positions of its seq_lens[b] keys. kv_cache [2, num_blocks, block_size, Hkv, D] (the new K/V already
    written); block_tables [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32;
    max_query_len: a host-side upper bound of the chunk lengths (sizes the grid). skip_decode: leave the rows
    of sequences with one query token untouched (the decode kernel does them) and run the others' tiles as a
    work list (a grid fixed by q's rows, not by max_query_len or B). Returns `out` (allocated like q
    if None); rows not covered by query_start_loc are not written. block_m .. maxnreg (registers per thread)
    override `default_prefill_config` (the tile sweep, `python -m heron.bench.kernels --prefill-only --sweep`).
    `sliding_window` W: each query sees its last W keys only; `soft_cap` c: scores s become c * tanh(s / c)
    (each a compiled variant of its own; None: full attention). A float8 (e4m3) cache is read as k * k_scale and
    v * v_scale. `split_workspace` (`make_split_workspace`, as many rows as q at least; no sliding window): up
    to its first dimension's count of programs share a query tile's keys before the tile, one per
    `min_split_keys` of them, and the last to finish merges their partial results (a step of few query tiles
    over long cached prefixes, which would otherwise walk its keys on a few SMs; see the module's docstring).
    """
    check_cache(kv_cache)
    fp8 = is_fp8(kv_cache.dtype)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch = seq_lens.shape[0]
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1, "q needs a contiguous head_dim"
    assert query_start_loc.shape[0] >= batch + 1
    assert block_tables.shape[0] >= batch and block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    if batch == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    cfg = default_prefill_config(head_dim, group, q.device)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    assert block_m >= 16 and block_m % g_pad == 0 and block_m & (block_m - 1) == 0, (
        f"block_m must be a power of two >= max(16, next_pow2(group)); got {block_m}"
    )
    assert block_n >= 16 and block_n & (block_n - 1) == 0
    block_q = block_m // g_pad
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    splits, part_o, part_lse, counts = 1, out, out, seq_lens
    if split_workspace is not None:
        part_o, part_lse, counts = split_workspace
        splits = part_o.shape[0]
        assert not sliding_window, "a sliding window's keys are not split"
        assert part_o.shape[2:] == (num_heads, head_dim) and part_o.shape[1] >= q.shape[0]
        assert part_lse.shape == part_o.shape[:3] and counts.shape == (part_o.shape[1], num_heads)
        assert part_o.is_contiguous() and part_lse.is_contiguous() and counts.is_contiguous()
    if skip_decode:  # the work list: a program per item of the tiles q's rows can fill (see the module's docstring)
        programs = max(triton.cdiv(q.shape[0], block_q) * splits, triton.cdiv(2 * num_sms(q.device), num_kv_heads))
        grid = (programs, 1, num_kv_heads)
    else:  # one slot per query tile of the longest chunk; a narrow batch's tiles get `splits` slots each
        slots = triton.cdiv(max_query_len, block_q) * (splits if batch <= SPLIT_SLOTS_MAX_SEQS else 1)
        grid = (slots, batch, num_kv_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_o,
        part_lse,
        counts,
        batch,
        part_o.shape[1],
        num_heads,
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
        G=group,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WORK_LIST=skip_decode,
        BLOCK_B=WORK_LIST_SEQS,
        UPCAST=dot_upcast(),
        PRECISION=dot_precision(q.dtype),
        WINDOW=sliding_window or 0,
        SOFT_CAP=soft_cap * LOG2E if soft_cap else 0.0,
        FP8=fp8,
        SPLITS=splits,
        MIN_TILES=max(1, min_split_keys // block_n),
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
        maxnreg=maxnreg or cfg["maxnreg"],
        **pdl_options(q.device, q.shape[0]),
    )
    return out
