"""Rotary position embedding (rotate-half layout) for q and k in one kernel, optionally after an RMSNorm over
each head (Qwen3's q_norm / k_norm).

Program (t, j) takes token t and a block of BLOCK_H heads: blocks j < ceil(H / BLOCK_H) are q's, the rest k's.
It loads each head as its two halves x1, x2 [BLOCK_H, D/2], the token's cos/sin row from the float32 table
`cos_sin` [max_pos, D] = cat(cos, sin) (each D/2 wide), and writes [x1 cos - x2 sin, x2 cos + x1 sin] to new
contiguous q/k tensors. q and k may be strided views of the fused qkv projection (last dim contiguous). The
grid (T, blocks of q + blocks of k) depends only on shapes, so it can be captured in a CUDA graph.

Rounding follows the model's PyTorch code (`heron.models.layers.rope_torch`, the reference, which runs on CPU):
the norm rounds as RMSNorm does (normalised head rounded to q's dtype, times the weight in float32, rounded to
the promoted dtype); the rotation is computed in float32 and rounded once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.rmsnorm import fix_bf16, round_to
from heron.models.layers import rope_torch as apply_rope_ref  # noqa: F401  (the reference, re-exported)


@triton.jit
def _rope_heads(x_ptr, out_ptr, w_ptr, t, head0, stride_t, stride_h, cos, sin, eps,
                NUM_HEADS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                FIX_BF16: tl.constexpr):
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < NUM_HEADS)[:, None]
    src = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        # weight * h.to(dtype), rounded to the norm's output dtype (= out's), as RMSNorm rounds it
        x1 = round_to(round_to(x1 * rstd, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w1,
                      out_ptr.dtype.element_ty, FIX_BF16).to(tl.float32)
        x2 = round_to(round_to(x2 * rstd, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32) * w2,
                      out_ptr.dtype.element_ty, FIX_BF16).to(tl.float32)
    dst = out_ptr + (t * NUM_HEADS + h[:, None]) * (2 * HALF) + d[None, :]
    tl.store(dst, round_to(x1 * cos - x2 * sin, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)
    tl.store(dst + HALF, round_to(x2 * cos + x1 * sin, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
                 BLOCK_H: tl.constexpr, HALF: tl.constexpr, FIX_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d)[None, :]
    q_blocks: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    if j < q_blocks:
        _rope_heads(q_ptr, q_out_ptr, qw_ptr, t, j * BLOCK_H, stride_qt, stride_qh, cos, sin, eps,
                    NUM_Q_HEADS, HAS_NORM, BLOCK_H, HALF, FIX_BF16)
    else:
        _rope_heads(k_ptr, k_out_ptr, kw_ptr, t, (j - q_blocks) * BLOCK_H, stride_kt, stride_kh, cos, sin, eps,
                    NUM_K_HEADS, HAS_NORM, BLOCK_H, HALF, FIX_BF16)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, *, q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous, other strides free), positions [T] (int32/int64),
    cos_sin [max_pos, D] float32 -> (q', k') new contiguous tensors (or `q_out` / `k_out`). With the norm
    weights [D], each head is RMS-normalised (eps) and scaled first. D must be a power of two."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and k.dtype == q.dtype, "q/k shapes or dtypes differ"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dimension"
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
    assert positions.shape == (num_tokens,)
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "give both norm weights or neither"
    out_dtype = q.dtype
    if has_norm:
        assert q_norm_weight.shape == (head_dim,) and k_norm_weight.shape == (head_dim,)
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
        assert q_norm_weight.dtype == k_norm_weight.dtype
        out_dtype = torch.promote_types(q_norm_weight.dtype, q.dtype)
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == out_dtype and k_out.dtype == out_dtype
    if num_tokens == 0:
        return q_out, k_out
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, 2048 // head_dim))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    _rope_kernel[grid](
        q, k, q_out, k_out, q_norm_weight if has_norm else q, k_norm_weight if has_norm else k, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HAS_NORM=has_norm, BLOCK_H=block_h, HALF=head_dim // 2,
        FIX_BF16=fix_bf16(),
        num_warps=4 if block_h * head_dim <= 2048 else 8)
    return q_out, k_out
