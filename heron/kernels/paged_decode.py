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

`rope_paged_decode_attention` turns on a prologue (constexpr ROPE) that does rope.apply_rope_and_cache's work
for a decode step inside this kernel, saving that kernel's launch and the gap after it (per layer). Program
(b, h, p) loads its G query heads unrotated (a view of the qkv projection), applies the q norm and RoPE with
rope.norm_rope and rounds to the cache dtype: the bits the unfused path stores and loads back, so the attention
that follows computes the same thing. Each of the P programs of (b, h) rotates q itself (G heads: negligible)
rather than sharing a copy through memory. The program whose partition holds the newest key (position
seq_len - 1, in partition (num_tiles - 1) // tpp, which is P - 1 only when the tiles divide evenly; partition 0
for a row without keys) normalises and rotates the new key, writes k and v at slot_mapping[b] (-1: a padded
row, nothing), then waits at a CTA barrier: a CTA's global stores are visible to all its threads after bar.sync,
so its tile loads then read the new key from the cache like any other. No other program reads that position.
The alternative, taking the new key and value from registers and masking their position out of the cache
reads, would add a merge to the hot tile loop (or a second copy of it) for the one program that needs it; the
barrier costs one bar.sync in that one program.

The grid depends only on (B, Hkv, P): nothing host-side that changes per step, so the step can be captured in
a CUDA graph with P fixed for the captured batch size; the counters are left zeroed by every call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from heron.kernels.attn_tile import LOG2E, attend_tile, dot_precision, tile_blocks
from heron.kernels.common import check_cache, dot_upcast, num_sms
from heron.kernels.rmsnorm import fix_bf16
from heron.kernels.rope import check_rope_and_cache, norm_rope


@triton.jit
def _rotated_q(q_ptr, qw_ptr, row, heads, g_ok, stride_qt, stride_qh, cos, sin, eps, DST: tl.constexpr,
               HAS_NORM: tl.constexpr, G_PAD: tl.constexpr, HALF: tl.constexpr, FIX_BF16: tl.constexpr):
    """Query heads `heads` of row `row` of the unrotated q, normed and rotated as rope.py does (its `norm_rope`)
    and rounded to DST: the [G_PAD, 2 * HALF] tile the unfused path would load from rope.py's output."""
    d = tl.arange(0, HALF)
    src = q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=g_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=g_ok[:, None], other=0.0).to(tl.float32)
    q1, q2 = norm_rope(x1, x2, qw_ptr, cos, sin, eps, q_ptr.dtype.element_ty, DST, HAS_NORM, HALF, FIX_BF16)
    # [G_PAD, HALF] x 2 -> [G_PAD, 2, HALF] -> [G_PAD, D]: each head's halves side by side
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (G_PAD, 2 * HALF))


@triton.jit
def _cache_new_kv(k_ptr, v_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, row, kvh, slot, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_cblk, stride_coff, stride_ch, cos, sin, eps, HAS_NORM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, FIX_BF16: tl.constexpr):
    """KV head kvh of row `row`'s new token: k normed and rotated (`norm_rope`), k and v stored at cache slot
    `slot` (int64, >= 0), as rope.apply_rope_and_cache stores them."""
    d = tl.arange(0, HALF)[None, :]
    src = k_ptr + row * stride_kt + kvh * stride_kh + d
    k1, k2 = norm_rope(tl.load(src).to(tl.float32), tl.load(src + HALF).to(tl.float32), kw_ptr, cos, sin, eps,
                       k_ptr.dtype.element_ty, k_cache_ptr.dtype.element_ty, HAS_NORM, HALF, FIX_BF16)
    dst = (slot // BLOCK_SIZE) * stride_cblk + (slot % BLOCK_SIZE) * stride_coff + kvh * stride_ch + d
    tl.store(k_cache_ptr + dst, k1)
    tl.store(k_cache_ptr + dst + HALF, k2)
    v_src = v_ptr + row * stride_vt + kvh * stride_vh + d
    tl.store(v_cache_ptr + dst, tl.load(v_src).to(v_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + HALF).to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                         part_o_ptr, part_m_ptr, part_l_ptr, count_ptr, qk_scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                         stride_cblk, stride_coff, stride_ch,
                         k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, eps,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
                         G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                         USE_QSL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         ROPE: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
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
    tiles_per_part = tl.cdiv(num_tiles, NUM_PARTS)
    t_begin = part * tiles_per_part
    t_end = tl.minimum(t_begin + tiles_per_part, num_tiles)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < G
    heads = kvh * G + g
    if ROPE:
        half = tl.arange(0, HEAD_DIM // 2)
        cs_row = cs_ptr + tl.load(pos_ptr + row).to(tl.int64) * stride_cs
        cos = tl.load(cs_row + half)[None, :]
        sin = tl.load(cs_row + HEAD_DIM // 2 + half)[None, :]
        q = _rotated_q(q_ptr, qw_ptr, row, heads, g_ok, stride_qt, stride_qh, cos, sin, eps,
                       k_cache_ptr.dtype.element_ty, HAS_NORM, G_PAD, HEAD_DIM // 2, FIX_BF16)
        # The partition whose tiles hold the newest key (seq_len - 1; partition 0 of a row without keys)
        if part == tl.maximum(num_tiles - 1, 0) // tl.maximum(tiles_per_part, 1):
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if slot >= 0:  # -1: a padded row
                _cache_new_kv(k_ptr, v_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, row, kvh, slot, stride_kt, stride_kh,
                              stride_vt, stride_vh, stride_cblk, stride_coff, stride_ch, cos, sin, eps, HAS_NORM,
                              BLOCK_SIZE, HEAD_DIM // 2, FIX_BF16)
                tl.debug_barrier()  # the CTA's stores are visible to all its threads' tile loads below
    else:
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None],
                    other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = kvh * stride_ch
    for t in range(t_begin, t_end):  # the kernel's num_stages pipelines the K/V loads (they feed dots)
        blk = tile_blocks(bt_row, t * BLOCK_N, seq_len, BLOCK_SIZE, BLOCK_N)
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, blk, kv_head_off, t * BLOCK_N,
                                    seq_len, stride_cblk, stride_coff, qk_scale,
                                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, UPCAST, PRECISION)

    out_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if NUM_PARTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padded row): zeros
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # Partials are [B, H, P, (D)] float32; l_i >= 1 in a partition that is not empty.
        base = (b * NUM_HEADS + heads) * NUM_PARTS  # [G_PAD]: partition 0 of each head
        wrote = g_ok & (t_begin < t_end)
        tl.store(part_o_ptr + (base + part)[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=wrote[:, None])
        tl.store(part_m_ptr + base + part, m_i, mask=wrote)
        tl.store(part_l_ptr + base + part, l_i, mask=wrote)
        tl.debug_barrier()  # every thread's partials are issued before the release below
        count = count_ptr + b * NUM_KV_HEADS + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_PARTS - 1:
            # The last to arrive: the partitions holding keys are the first ceil(num_tiles / tiles_per_part).
            num_valid = tl.cdiv(num_tiles, tl.maximum(tiles_per_part, 1))
            p = tl.arange(0, PARTS_PAD)
            m_all = tl.load(part_m_ptr + base[:, None] + p[None, :], mask=g_ok[:, None] & (p < num_valid)[None, :],
                            other=float("-inf"), cache_modifier=".cg")
            m_max = tl.max(m_all, 1)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no keys (a padded row): zeros below
            acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
            denom = tl.zeros([G_PAD], tl.float32)
            for s in range(0, num_valid):  # in partition order: the same sum whichever partition arrived last
                m_s = tl.load(part_m_ptr + base + s, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(part_l_ptr + base + s, mask=g_ok, other=0.0, cache_modifier=".cg")
                w = l_s * tl.exp2(m_s - m_max)
                o_s = tl.load(part_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=g_ok[:, None],
                              other=0.0, cache_modifier=".cg")
                acc += o_s * w[:, None]
                denom += w
            out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
            tl.store(count, 0)


def default_num_partitions(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """KV partitions per sequence: enough (batch_size * num_kv_heads * P) programs for about four per SM,
    a power of two in [1, 16]. A function of the batch size and the model only, so one captured graph per
    batch size keeps one value."""
    want = triton.cdiv(4 * num_sms(device), max(1, batch_size * num_kv_heads))
    return min(16, triton.next_power_of_2(max(1, want)))


def default_block_n(block_size: int, num_partitions: int, elem_size: int) -> int:
    """Keys per tile: 128 for a 16-bit cache when each program has a long run of keys (at most two partitions:
    batch x KV heads fill the GPU), else 64. Swept on an H200 (perf_notes run 20): 128 keys with 3 stages took
    batch 100 (~1,200-token contexts) from 140 to 127 us, batch 200 177 -> 172, the `kernels` case (batch 64,
    P 2) 105.5 -> 103. A float32 cache keeps 64 keys: 128 would take ~148 KB of shared memory at D 128 (sm_90
    build), more than GPUs with ~100 KB per SM have."""
    return max(128 if num_partitions <= 2 and elem_size <= 2 else 64, block_size)


DecodeWorkspace = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_decode_workspace(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, num_partitions: int,
                          device: torch.device) -> DecodeWorkspace:
    """Split-KV decode's float32 partials (out [B, H, P, D], max [B, H, P], sum [B, H, P]) and zeroed int32
    arrival counters [B, Hkv]. Allocate once (per batch size) and pass it in: a captured graph then keeps
    fixed addresses."""
    part_o = torch.empty(batch_size, num_heads, num_partitions, head_dim, dtype=torch.float32, device=device)
    part_m = torch.empty(batch_size, num_heads, num_partitions, dtype=torch.float32, device=device)
    part_l = torch.empty(batch_size, num_heads, num_partitions, dtype=torch.float32, device=device)
    return part_o, part_m, part_l, torch.zeros(batch_size, num_kv_heads, dtype=torch.int32, device=device)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                           num_partitions: int | None = None, query_start_loc: torch.Tensor | None = None,
                           workspace: DecodeWorkspace | None = None,
                           block_n: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache.

    q [B, H, D] (one query per sequence, row b is sequence b), or, with `query_start_loc` [B + 1] int32,
    q [T, H, D] of a mixed batch: sequence b's row is query_start_loc[b] and sequences whose query length is
    not 1 are skipped (their output rows are left untouched). kv_cache [2, num_blocks, block_size, Hkv, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (keys per sequence, the query's own included;
    0 gives zeros). `workspace`: `make_decode_workspace`'s, for P > 1 (else one is allocated). Returns `out`
    (allocated like q if None). No host-device sync; the grid is (B, Hkv, P).
    """
    if query_start_loc is None:
        assert q.shape[0] >= seq_lens.shape[0], "q needs one row per sequence"
    if out is None:
        out = torch.empty_like(q)
    return _launch(q, kv_cache, block_tables, seq_lens, scale, out, num_partitions, query_start_loc, workspace,
                   block_n, num_warps, num_stages, None)


class DecodeRope(NamedTuple):
    """The fused prologue's inputs (`rope_paged_decode_attention`), as rope.apply_rope_and_cache takes them."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float


def rope_paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                                eps: float = 1e-6, *, out: torch.Tensor | None = None,
                                num_partitions: int | None = None, workspace: DecodeWorkspace | None = None,
                                block_n: int | None = None, num_warps: int = 4,
                                num_stages: int | None = None) -> torch.Tensor:
    """`apply_rope_and_cache` then `paged_decode_attention`, in one launch: q [B, H, D], k, v [B, Hkv, D] the
    unrotated views of the qkv projection (last dim contiguous), row b sequence b's new token at positions[b],
    written at slot_mapping[b] (-1: nothing) and attended to as key seq_lens[b] - 1. The other arguments and the
    result are those of the two calls; out [B, H, D] (allocated if None) has the cache's dtype."""
    check_rope_and_cache(q, k, v, positions, cos_sin, kv_cache, slot_mapping, q_norm_weight, k_norm_weight)
    batch = seq_lens.shape[0]
    assert q.shape[0] >= batch and slot_mapping.shape[0] >= batch, "q and slot_mapping need one row per sequence"
    if out is None:
        out = torch.empty(q.shape, dtype=kv_cache.dtype, device=q.device)
    assert out.dtype == kv_cache.dtype
    rope = DecodeRope(k, v, positions, cos_sin, slot_mapping, q_norm_weight, k_norm_weight, eps)
    return _launch(q, kv_cache, block_tables, seq_lens, scale, out, num_partitions, None, workspace, block_n,
                   num_warps, num_stages, rope)


def _launch(q, kv_cache, block_tables, seq_lens, scale, out, num_partitions, query_start_loc, workspace, block_n,
            num_warps, num_stages, rope: DecodeRope | None) -> torch.Tensor:
    """Both entry points' launch; `rope` (or None: q is already rotated, the cache already written) turns on the
    fused prologue."""
    check_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    batch = seq_lens.shape[0]
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1, "q needs a contiguous head_dim"
    assert block_tables.shape[0] >= batch and block_tables.stride(-1) == 1
    assert out.shape == q.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_partitions is None:
        num_partitions = default_num_partitions(batch, num_kv_heads, q.device)
    block_n = block_n or default_block_n(block_size, num_partitions, kv_cache.element_size())
    if num_partitions > 1:
        if workspace is None:
            workspace = make_decode_workspace(batch, num_heads, num_kv_heads, head_dim, num_partitions, q.device)
        part_o, part_m, part_l, counts = workspace
        assert part_o.shape[0] >= batch and part_o.shape[1:] == (num_heads, num_partitions, head_dim)
        assert part_o.is_contiguous() and part_m.is_contiguous() and part_l.is_contiguous()
        assert counts.dtype == torch.int32 and counts.numel() >= batch * num_kv_heads and counts.is_contiguous()
    else:
        part_o = part_m = part_l = counts = out  # unused
    use_qsl = query_start_loc is not None
    qsl = query_start_loc if use_qsl else seq_lens  # a placeholder pointer when unused
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    has_norm = rope is not None and rope.q_norm_weight is not None
    if rope is None:  # placeholders: the prologue's pointers and strides are not read
        rope_args = (q, q, q, q, seq_lens, q, seq_lens, 0, 0, 0, 0, 0, 0.0)
    else:
        k, v = rope.k, rope.v
        rope_args = (k, v, rope.q_norm_weight if has_norm else q, rope.k_norm_weight if has_norm else k,
                     rope.positions, rope.cos_sin, rope.slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                     v.stride(1), rope.cos_sin.stride(0), rope.eps)
    _paged_decode_kernel[(batch, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, qsl, out, part_o, part_m, part_l, counts, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *rope_args,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, G=group, G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_PARTS=num_partitions,
        PARTS_PAD=triton.next_power_of_2(num_partitions), USE_QSL=use_qsl, UPCAST=dot_upcast(),
        PRECISION=dot_precision(kv_cache.dtype), ROPE=rope is not None, HAS_NORM=has_norm, FIX_BF16=fix_bf16(),
        num_warps=num_warps,
        num_stages=num_stages or (3 if block_n >= 128 and kv_cache.element_size() <= 2 else 2))
    return out


def paged_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """PyTorch reference: q [B, H, D], one query per sequence attending to all of its seq_lens[b] keys.
    Computed in float32; returns q's dtype. Reads seq_lens on the host (a sync): tests only."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = (kv_cache[j, blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) for j in (0, 1))
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
