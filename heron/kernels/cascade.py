"""Cascade (shared-prefix) decode attention: the prefix half.

When many decoding sequences hold the same cached prefix blocks (a long system prompt), the plain decode kernel
reads that prefix's K/V once per sequence. Here it is read once per tile of sequences: program (t, h, p) takes the
up to TILE_SEQS member sequences of tile t (all of one group, sharing its first `tile_len[t]` keys) times the G
query heads of KV head h as the BLOCK_M = TILE_SEQS * G_PAD rows of one query tile (row r = member r // G_PAD,
head r % G_PAD), as the prefill kernel batches a chunk's tokens, and folds partition p of the prefix's key tiles
into an online softmax (`attn_tile.attend_tile`: any number of rows, one key range). It stores each member's
partial result, normalised output and log2-domain log-sum-exp (-inf for an empty partition), per partition;
the decode kernel (paged_decode.py, `kv_start` / `prefix`) then attends each member's own suffix and merges
these partials into its output with the log-sum-exp weights, so nothing is normalised twice.

Launch: 64-key tiles, 4 warps, 3 stages for a 16-bit cache. 4 warps ran the prefix workload ~1% faster than 8
(H100, BENCHMARKS.md); in the sm_90 build with the launch's alignment (benchmarks/sass_probe.py's) neither
spills at 64 x 128 query tiles.

The grid (max tiles, Hkv, partitions) depends on the padded batch size only: the grouping is data (tile lengths
and members, in device buffers the step overwrites), a tile of length 0 exits at once, and a decode step with
its groups replays in a CUDA graph. The prefix is split into a fixed number of partitions (4 by default), so a
group's ~2,000 prefix keys spread over 4 programs a KV head.

Rows: in a pure decode step sequence b's query is q row b; in a mixed step (decode rows beside prompt chunks,
`query_start_loc`) it is q row query_start_loc[b], and only decode rows are members.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.attn_tile import LOG2E, attend_tile, dot_precision
from heron.kernels.common import check_cache, dot_upcast, pdl_enter, pdl_options
from heron.kernels.reference import is_fp8

PREFIX_PARTS = 4  # prefix partitions per (tile, KV head)
BLOCK_M = 64  # query rows per tile: members x G_PAD


def tile_seqs(num_heads: int, num_kv_heads: int, block_m: int = BLOCK_M) -> int:
    """Member sequences per prefix tile: the rows of a BLOCK_M query tile over the G heads of one KV head."""
    return max(1, block_m // triton.next_power_of_2(num_heads // num_kv_heads))


@triton.jit
def _cascade_prefix_kernel(
    q_ptr,
    qsl_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    tile_len_ptr,
    members_ptr,
    prefix_o_ptr,
    prefix_lse_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_cblk,
    stride_coff,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    TILE_SEQS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr,
    USE_QSL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    prefix_len = tl.load(tile_len_ptr + tile)
    if prefix_len == 0:  # an unused tile slot
        return
    r = tl.arange(0, TILE_SEQS * G_PAD)
    d = tl.arange(0, HEAD_DIM)
    seq = tl.load(members_ptr + tile * TILE_SEQS + r // G_PAD)  # -1: no member
    gh = r % G_PAD
    row_ok = (seq >= 0) & (gh < G)
    seq = tl.where(row_ok, seq, 0).to(tl.int64)
    heads = kvh * G + gh
    q_row = seq
    if USE_QSL:  # a mixed step: a member's one query row
        q_row = tl.load(qsl_ptr + seq, mask=row_ok, other=0).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    # Every member's table starts with the prefix's blocks: the first member's row serves all.
    bt_row = bt_ptr + tl.load(members_ptr + tile * TILE_SEQS).to(tl.int64) * stride_bt
    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_part = tl.cdiv(num_tiles, PARTS)
    t_begin = part * tiles_per_part
    t_end = tl.minimum(t_begin + tiles_per_part, num_tiles)
    m_i = tl.full([TILE_SEQS * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_SEQS * G_PAD], tl.float32)
    acc = tl.zeros([TILE_SEQS * G_PAD, HEAD_DIM], tl.float32)
    kv_head_off = kvh * stride_ch
    for t in range(t_begin, t_end):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n < prefix_len, other=0).to(tl.int64)
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
            0,
            prefix_len,
            stride_cblk,
            stride_coff,
            qk_scale,
            v_scale,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            UPCAST,
            PRECISION,
            0,
            SOFT_CAP,
            FP8,
        )
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    idx = (seq * NUM_HEADS + heads) * PARTS + part
    tl.store(prefix_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
    tl.store(prefix_lse_ptr + idx, lse, mask=row_ok)


def make_prefix_workspace(
    batch_size: int, num_heads: int, head_dim: int, device: torch.device, parts: int = PREFIX_PARTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix partials: out [B, H, parts, D] and lse [B, H, parts], float32 (rows of sequences in no group
    are never written nor read)."""
    return (
        torch.empty(batch_size, num_heads, parts, head_dim, dtype=torch.float32, device=device),
        torch.empty(batch_size, num_heads, parts, dtype=torch.float32, device=device),
    )


def cascade_prefix_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tile_len: torch.Tensor,
    tile_members: torch.Tensor,
    scale: float,
    workspace: tuple[torch.Tensor, torch.Tensor],
    *,
    soft_cap: float | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each tile's member sequences over their shared prefix.

    q [B, H, D] (row b: sequence b), or with `query_start_loc` [B + 1] int32 q [T, H, D] of a mixed step
    (sequence b's row: query_start_loc[b]; members must be one-token rows); kv_cache [2, num_blocks,
    block_size, Hkv, D]; block_tables [B, max_blocks] int32; tile_len [T] int32 (prefix keys of tile t; 0: an
    unused tile) and tile_members [T, tile_seqs(H, Hkv)] int32 (member sequences, -1: none; the first is a
    member whenever tile_len > 0): `heron/attention/cascade.py` plans them. `workspace`:
    `make_prefix_workspace`'s, written at the members' rows. Returns the workspace (out, lse), for
    `paged_decode_attention(..., prefix=...)`. A float8 cache is read as k * k_scale and v * v_scale. No
    host-device sync; the grid is (T, Hkv, parts)."""
    check_cache(kv_cache)
    fp8 = is_fp8(kv_cache.dtype)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    prefix_o, prefix_lse = workspace
    parts = prefix_lse.shape[-1]
    seqs = tile_members.shape[1]
    assert q.stride(-1) == 1 and q.shape[2] == head_dim and block_tables.stride(-1) == 1
    assert tile_members.is_contiguous() and tile_len.shape[0] == tile_members.shape[0]
    assert (
        prefix_o.is_contiguous() and prefix_lse.is_contiguous() and prefix_o.shape[1:] == (num_heads, parts, head_dim)
    )
    g_pad = triton.next_power_of_2(group)
    assert seqs * g_pad >= 16 and seqs & (seqs - 1) == 0, "a tile needs >= 16 rows, a power of two"
    block_n = block_n or max(64, block_size)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (tile_len.shape[0], num_kv_heads, parts)
    _cascade_prefix_kernel[grid](
        q,
        query_start_loc if query_start_loc is not None else tile_len,  # (a placeholder pointer when unused)
        k_cache,
        v_cache,
        block_tables,
        tile_len,
        tile_members,
        prefix_o,
        prefix_lse,
        scale * LOG2E * (k_scale if fp8 else 1.0),
        v_scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        G=group,
        G_PAD=g_pad,
        TILE_SEQS=seqs,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTS=parts,
        UPCAST=dot_upcast(),
        PRECISION=dot_precision(q.dtype),
        SOFT_CAP=soft_cap * LOG2E if soft_cap else 0.0,
        FP8=fp8,
        USE_QSL=query_start_loc is not None,
        num_warps=num_warps,
        num_stages=num_stages or (3 if kv_cache.element_size() <= 2 else 2),
        **pdl_options(q.device, q.shape[0]),
    )
    return workspace
