"""The decode kernel's inner step: one tile of BLOCK_N keys/values gathered from the paged cache through their
block ids, folded into a running (online-softmax) accumulator. The prefill kernel has a loop of its own
(paged_prefill._attend_keys: block-table reads one tile ahead, the scale inside the exponent's FMA), tuned
for its register budget of two programs per SM.

Scores are kept in the log2 domain: `qk_scale` is softmax_scale * log2(e), so exp2 replaces exp.

Two attention variants are constexpr switches that compile out when off (0), so full causal attention builds
the kernels it always did: WINDOW (a sliding window: each query sees its last WINDOW keys, its own included)
and SOFT_CAP (Gemma 2's soft-capped scores c * tanh(s / c), given in the log2 domain as c * log2(e)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from heron.kernels.common import tanh


@triton.jit
def tile_blocks(bt_row_ptr, n0, kv_lo, kv_len, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """The cache block of each of keys n0 .. n0+BLOCK_N-1 (block 0 past kv_len, and with WINDOW before kv_lo),
    int64: token n sits in block bt_row[n // BLOCK_SIZE] at offset n % BLOCK_SIZE (int64: the cache may pass
    2**31 elements)."""
    n = n0 + tl.arange(0, BLOCK_N)
    if WINDOW:
        return tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=(n >= kv_lo) & (n < kv_len), other=0).to(tl.int64)
    return tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n < kv_len, other=0).to(tl.int64)


@triton.jit
def soft_cap(s, SOFT_CAP: tl.constexpr):
    """Scores s (log2 domain) capped as c * tanh(s / c), SOFT_CAP = c * log2(e): the cap in the same domain."""
    return SOFT_CAP * tanh(s * (1.0 / SOFT_CAP))


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    blk,
    kv_head_off,
    n0,
    kv_lo,
    kv_len,
    stride_cblk,
    stride_coff,
    qk_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr,
):
    """acc [M, D] f32, m_i/l_i [M] f32 (running max / sum), q [M, D]. Keys n0 .. n0+BLOCK_N-1, those
    n >= kv_len (and with WINDOW those n < kv_lo) masked and not loaded; blk: their cache blocks
    (`tile_blocks`). PRECISION: tl.dot's input_precision; "ieee" for float32 q, whose default would be TF32.
    FP8: a float8 cache, read through `fp8_kv`, k_scale folded into qk_scale by the caller and v_scale into the
    probabilities here."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    n_ok = n < kv_len
    if WINDOW:
        n_ok = n_ok & (n >= kv_lo)
    row_off = blk * stride_cblk + (n % BLOCK_SIZE) * stride_coff + kv_head_off
    kv_off = row_off[:, None] + d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=n_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=n_ok[:, None], other=0.0)
    if FP8:
        k, v = fp8_kv(k, v, q)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N] f32
    if SOFT_CAP > 0:
        s = soft_cap(s, SOFT_CAP)
    s = tl.where(n_ok[None, :], s, float("-inf"))
    # Every row has seen at least one unmasked key before or in this tile (callers guarantee it), so m_new
    # is finite and no exp2(-inf - -inf) occurs.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        p = p * v_scale
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def fp8_kv(k, v, q):
    """A tile of a float8 cache's K and V in q's dtype, unscaled (exact: e4m3 values fit in bf16 and fp16). The
    kernels fold the per-tensor scales into what they multiply anyway, k_scale into the score scale and v_scale
    into the probabilities: one multiply per score instead of one per element, the result that of k * k_scale
    and v * v_scale."""
    return k.to(tl.float32).to(q.dtype), v.to(tl.float32).to(q.dtype)


LOG2E = 1.4426950408889634


def dot_precision(dtype) -> str:
    """input_precision for the attention dots, by q's dtype (the dots' operands; a float8 cache is cast to it):
    exact float32 for float32 (the correctness runs compare with transformers in float32), the default otherwise
    (bf16/fp16 operands use tensor cores)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def merge_prefix(
    acc,
    m_i,
    l_i,
    prefix_o_ptr,
    prefix_lse_ptr,
    b,
    heads,
    g_ok,
    has_prefix,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PREFIX_PARTS: tl.constexpr,
):
    """Fold a cascade's shared-prefix partials (heron/kernels/cascade.py) into a decode row's running state:
    acc [G, D] relative to the max m_i [G], l_i [G] its sum; the prefix's PREFIX_PARTS partials of sequence b
    are normalised outputs [B, H, PREFIX_PARTS, D] and log2-domain log-sum-exps [B, H, PREFIX_PARTS] (-inf: no
    keys). Returns (acc, l_i) relative to the new max (the caller divides). `has_prefix` False: unchanged."""
    d = tl.arange(0, HEAD_DIM)
    base = (b * NUM_HEADS + heads) * PREFIX_PARTS
    ok = g_ok & has_prefix
    for s in tl.static_range(PREFIX_PARTS):
        lse = tl.load(prefix_lse_ptr + base + s, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_i, lse)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # neither has keys (a padded row): stays zero
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        o = tl.load(prefix_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    return acc, l_i
