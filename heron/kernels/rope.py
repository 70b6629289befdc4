"""Rotary position embedding (rotate-half layout) for q and k in one kernel, optionally after an RMSNorm over
each head (Qwen3's q_norm / k_norm).

Program (t, j) takes token t and a block of BLOCK_H heads: blocks j < ceil(H / BLOCK_H) are q's, the rest k's.
It loads each head as its two halves x1, x2 [BLOCK_H, D/2], the token's cos/sin row from the float32 table
`cos_sin` [max_pos, D] = cat(cos, sin) (each D/2 wide), and writes [x1 cos - x2 sin, x2 cos + x1 sin] to new
contiguous q/k tensors. q and k may be strided views of the fused qkv projection (last dim contiguous). The
grid (T, blocks of q + blocks of k) depends only on shapes, so it can be captured in a CUDA graph.

`apply_rope_and_cache` writes the rotated k, and v, straight into the paged KV cache at each token's slot
(block * block_size + offset; -1, or a row past slot_mapping, is a padded row and writes nothing) instead of
into new tensors: the K/V write is then no kernel of its own (at batch 1 one launch and its gap per layer).

Rounding follows the model's PyTorch code (`heron.kernels.reference.apply_rope_ref`, which runs on CPU):
the norm rounds as RMSNorm does (normalised head rounded to q's dtype, times the weight in float32, rounded to
the promoted dtype); the rotation is computed in float32 and rounded once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import check_cache, pdl_enter, pdl_options, to_fp8
from heron.kernels.reference import is_fp8
from heron.kernels.rmsnorm import fix_bf16, round_to


@triton.jit
def _rope_heads(
    x_ptr,
    dst_ptr,
    w_ptr,
    t,
    head0,
    stride_t,
    stride_h,
    dst_stride_h,
    cos,
    sin,
    eps,
    row_ok,
    ty_ptr,
    inv_scale,
    NUM_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    FIX_BF16: tl.constexpr,
    FP8: tl.constexpr,
):
    """Heads head0 .. head0 + BLOCK_H of token t: (norm,) rotate, rounded to ty_ptr's element type (the model's),
    store at dst_ptr + head * dst_stride_h (FP8: a float8 cache, `to_fp8` of the rounded value times inv_scale)."""
    ty = ty_ptr.dtype.element_ty
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < NUM_HEADS)[:, None] & row_ok
    src = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        # weight * h.to(dtype), rounded to the norm's output dtype (= the destination's), as RMSNorm rounds it
        x1 = round_to(
            round_to(x1 * rstd, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w1,
            ty,
            FIX_BF16,
        ).to(tl.float32)
        x2 = round_to(
            round_to(x2 * rstd, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w2,
            ty,
            FIX_BF16,
        ).to(tl.float32)
    dst = dst_ptr + h[:, None] * dst_stride_h + d[None, :]
    y1 = round_to(x1 * cos - x2 * sin, ty, FIX_BF16)
    y2 = round_to(x2 * cos + x1 * sin, ty, FIX_BF16)
    if FP8:  # (FIX_BF16, set under the interpreter, fixes its float8 cast too)
        y1, y2 = to_fp8(y1, inv_scale, dst_ptr, FIX_BF16), to_fp8(y2, inv_scale, dst_ptr, FIX_BF16)
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cs_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cblk,
    stride_coff,
    stride_ch,
    num_slots,
    eps,
    inv_k_scale,
    inv_v_scale,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    TO_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FIX_BF16: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d)[None, :]
    q_blocks: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    if j < q_blocks:
        _rope_heads(
            q_ptr,
            q_out_ptr + t * (NUM_Q_HEADS * 2 * HALF),
            qw_ptr,
            t,
            j * BLOCK_H,
            stride_qt,
            stride_qh,
            2 * HALF,
            cos,
            sin,
            eps,
            t >= 0,
            q_out_ptr,
            1.0,
            NUM_Q_HEADS,
            HAS_NORM,
            BLOCK_H,
            HALF,
            FIX_BF16,
            False,
        )
    else:
        head0 = (j - q_blocks) * BLOCK_H
        if TO_CACHE:  # k and v go to the token's slot of the cache [num_blocks, block_size, Hkv, D]
            slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
            row_ok = slot >= 0
            slot = tl.maximum(slot, 0)
            base = (slot // BLOCK_SIZE) * stride_cblk + (slot % BLOCK_SIZE) * stride_coff
            _rope_heads(
                k_ptr,
                k_out_ptr + base,
                kw_ptr,
                t,
                head0,
                stride_kt,
                stride_kh,
                stride_ch,
                cos,
                sin,
                eps,
                row_ok,
                q_out_ptr,
                inv_k_scale,
                NUM_K_HEADS,
                HAS_NORM,
                BLOCK_H,
                HALF,
                FIX_BF16,
                FP8,
            )
            h = head0 + tl.arange(0, BLOCK_H)
            dd = tl.arange(0, 2 * HALF)
            mask = (h < NUM_K_HEADS)[:, None] & row_ok
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dd[None, :], mask=mask)
            if FP8:
                v = to_fp8(v, inv_v_scale, v_out_ptr, FIX_BF16)
            tl.store(
                v_out_ptr + base + h[:, None] * stride_ch + dd[None, :], v.to(v_out_ptr.dtype.element_ty), mask=mask
            )
        else:
            _rope_heads(
                k_ptr,
                k_out_ptr + t * (NUM_K_HEADS * 2 * HALF),
                kw_ptr,
                t,
                head0,
                stride_kt,
                stride_kh,
                2 * HALF,
                cos,
                sin,
                eps,
                t >= 0,
                k_out_ptr,
                1.0,
                NUM_K_HEADS,
                HAS_NORM,
                BLOCK_H,
                HALF,
                FIX_BF16,
                False,
            )


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
):
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous, other strides free), positions [T] (int32/int64),
    cos_sin [max_pos, D] float32 -> (q', k') new contiguous tensors (or `q_out` / `k_out`). With the norm
    weights [D], each head is RMS-normalised (eps) and scaled first. D must be a power of two."""
    out_dtype = _check(q, k, positions, cos_sin, q_norm_weight, k_norm_weight)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    assert k_out.shape == k.shape and k_out.is_contiguous() and k_out.dtype == out_dtype
    q_out = _launch(
        q, k, None, positions, cos_sin, q_norm_weight, k_norm_weight, eps, q_out, k_out, None, None, (1.0, 1.0)
    )
    return q_out, k_out


def apply_rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    q_out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`apply_rope`, with the rotated k and v [T, Hkv, D] written into kv_cache [2, num_blocks, block_size, Hkv,
    D] at slot_mapping [T'] (int32/int64; -1, or a row t >= T', writes nothing) instead of new tensors. A float8
    cache takes k / k_scale and v / v_scale, each rounded to the model's dtype first, clamped to +-448 (as
    `reference.write_kv_ref`). Returns q'."""
    out_dtype = _check(q, k, positions, cos_sin, q_norm_weight, k_norm_weight)
    check_cache(kv_cache)
    fp8 = is_fp8(kv_cache.dtype)
    assert kv_cache.shape[3:] == k.shape[1:] and (fp8 or kv_cache.dtype == out_dtype), (
        f"k {tuple(k.shape)} {out_dtype} does not match the cache {tuple(kv_cache.shape)} {kv_cache.dtype}"
    )
    assert v.shape == k.shape and v.stride(-1) == 1 and slot_mapping.dim() == 1
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    return _launch(
        q,
        k,
        v,
        positions,
        cos_sin,
        q_norm_weight,
        k_norm_weight,
        eps,
        q_out,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        (1.0 / k_scale, 1.0 / v_scale),
    )


def _check(q, k, positions, cos_sin, q_norm_weight, k_norm_weight) -> torch.dtype:
    """The shapes both entry points take; returns the output dtype (q's, promoted with the norm weights')."""
    num_tokens, _, head_dim = q.shape
    assert k.shape == (num_tokens, k.shape[1], head_dim) and k.dtype == q.dtype, "q/k shapes or dtypes differ"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dimension"
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
    assert positions.shape == (num_tokens,)
    assert (q_norm_weight is None) == (k_norm_weight is None), "give both norm weights or neither"
    if q_norm_weight is None:
        return q.dtype
    assert q_norm_weight.shape == (head_dim,) and k_norm_weight.shape == (head_dim,)
    assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    assert q_norm_weight.dtype == k_norm_weight.dtype
    return torch.promote_types(q_norm_weight.dtype, q.dtype)


def _launch(
    q, k, v, positions, cos_sin, q_norm_weight, k_norm_weight, eps, q_out, k_out, v_cache, slot_mapping, inv_scales
):
    """k_out: a new [T, Hkv, D] tensor, or (with v) the K half of the cache and v_cache its V half (`inv_scales`:
    1 / (k_scale, v_scale), for a float8 one)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    has_norm = q_norm_weight is not None
    out_dtype = q_out.dtype if is_fp8(k_out.dtype) else k_out.dtype  # (apply_rope_and_cache makes q_out then)
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    assert q_out.shape == q.shape and q_out.is_contiguous() and q_out.dtype == out_dtype
    if num_tokens == 0:
        return q_out
    to_cache = v is not None
    cache_strides = (k_out.stride(0), k_out.stride(1), k_out.stride(2)) if to_cache else (0, 0, 0)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, 2048 // head_dim))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    _rope_kernel[grid](
        q,
        k,
        v if to_cache else k,
        q_out,
        k_out,
        v_cache if to_cache else k_out,
        q_norm_weight if has_norm else q,
        k_norm_weight if has_norm else k,
        positions,
        cos_sin,
        slot_mapping if to_cache else positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0) if to_cache else 0,
        v.stride(1) if to_cache else 0,
        cos_sin.stride(0),
        *cache_strides,
        slot_mapping.shape[0] if to_cache else 0,
        eps,
        *inv_scales,
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HAS_NORM=has_norm,
        BLOCK_H=block_h,
        HALF=head_dim // 2,
        TO_CACHE=to_cache,
        BLOCK_SIZE=k_out.shape[1] if to_cache else 1,
        FIX_BF16=fix_bf16(),
        FP8=is_fp8(k_out.dtype),
        num_warps=4 if block_h * head_dim <= 2048 else 8,
        **pdl_options(q.device, num_tokens),
    )
    return q_out
