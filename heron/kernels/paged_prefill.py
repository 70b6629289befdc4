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

`max_query_len` is a host int (AttentionMetadata has it): no device read-back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attn_tile import LOG2E, attend_tile, dot_precision
from heron.kernels.common import check_cache, dot_upcast


@triton.jit
def _paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                          stride_cblk, stride_coff, stride_ch,
                          G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_DECODE: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    qt = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qt * BLOCK_Q >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:  # left to the decode kernel
            return
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
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None], other=0.0)
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
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, n0,
                                    kv_end, pos, stride_cblk, stride_coff, qk_scale,
                                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, UPCAST, PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off, n0,
                                    kv_end, pos, stride_cblk, stride_coff, qk_scale,
                                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, UPCAST, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def default_prefill_config(head_dim: int, group: int, device: torch.device) -> dict:
    """Tile sizes and launch options. BLOCK_M rows = (query tokens) x (padded GQA group)."""
    g_pad = triton.next_power_of_2(group)
    if device.type != "cuda":  # the interpreter: small tiles are faster there
        return dict(block_m=max(16, g_pad), block_n=16, num_warps=4, num_stages=1)
    # From a sweep on an H200 (4 x 2048-token prompts, bf16; docs/kernels.md): D 128 -> 128 x 32 tiles,
    # 8 warps (~335 TFLOP/s); D 64 -> 64 x 64, 4 warps (~260-300).
    if head_dim >= 128:
        return dict(block_m=max(128, g_pad), block_n=32, num_warps=8, num_stages=2)
    return dict(block_m=max(64, g_pad), block_n=64, num_warps=4, num_stages=2)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                            scale: float, *, out: torch.Tensor | None = None, skip_decode: bool = False,
                            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys.

    q [T, H, D]; sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1] and sit at the last
    q_len positions of its seq_lens[b] keys. kv_cache [2, num_blocks, block_size, Hkv, D] (the new K/V already
    written); block_tables [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32;
    max_query_len: a host-side upper bound of the chunk lengths (sizes the grid). skip_decode: leave the rows
    of sequences with one query token untouched (the decode kernel does them). Returns `out` (allocated like q
    if None); rows not covered by query_start_loc are not written.
    """
    check_cache(kv_cache)
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
    assert block_m >= 16 and block_m % g_pad == 0 and block_m & (block_m - 1) == 0, \
        f"block_m must be a power of two >= max(16, next_pow2(group)); got {block_m}"
    assert block_n >= 16 and block_n & (block_n - 1) == 0
    block_q = block_m // g_pad
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_q), batch, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, G_PAD=g_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SKIP_DECODE=skip_decode, UPCAST=dot_upcast(), PRECISION=dot_precision(kv_cache.dtype),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])
    return out


def paged_prefill_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch reference in float32 (returns q's dtype): per sequence, causal attention of its q_len new
    queries, at positions seq_len - q_len .. seq_len - 1, over its keys. Reads lengths on the host: tests only."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        a, e = starts[b], starts[b + 1]
        if e == a:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k, v = (kv_cache[j, blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1) for j in (0, 1))
        s = torch.einsum("thd,nhd->htn", q[a:e].float(), k) * scale
        pos = torch.arange(n - (e - a), n, device=q.device)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[a:e] = torch.einsum("htn,nhd->thd", s.softmax(-1), v).to(q.dtype)
    return out
