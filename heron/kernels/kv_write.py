"""Write the step's new K/V rows into the paged cache.

One program per token row: it reads the row's slot (block * block_size + offset), returns at once for a
slot of -1 (a padded row), else copies that token's [Hkv, D] keys and values into
cache[0/1, block, offset]. The grid is (T,), fixed for a fixed padded token count, so it can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import check_cache


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cblk, stride_coff, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_KV_HEADS)[:, None]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = blk * stride_cblk + off * stride_coff + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (last dim contiguous; other strides free) -> kv_cache [2, num_blocks, block_size, Hkv, D]
    at slot_mapping [T] (int32/int64; -1 = skip the row). In place; launches one program per row."""
    check_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    assert k.shape[0] >= num_tokens and v.shape[0] >= num_tokens
    assert k.shape[1:] == (num_kv_heads, head_dim) and v.shape[1:] == (num_kv_heads, head_dim), \
        f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the cache {tuple(kv_cache.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need a contiguous last dimension"
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, num_warps=4 if num_kv_heads * head_dim >= 1024 else 1)


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """The same in PyTorch (rows with slot -1 skipped)."""
    keep = slot_mapping >= 0
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    slots = slot_mapping[keep].long()
    flat[0].index_copy_(0, slots, k[: slot_mapping.shape[0]][keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[: slot_mapping.shape[0]][keep].to(kv_cache.dtype))
