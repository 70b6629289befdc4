"""Int4 weight-only (W4A16) matmuls: a GEMV that dequantizes on load for decode batches, and a dequantize
kernel before cuBLAS for larger ones.

The layout (every int4 checkpoint format is converted to it at load, heron/models/int4_formats.py):
- `weight` int32 [N, K/8]: row n's K unsigned nibbles, element 8w + j in bits 4j..4j+3 of word w;
- `weight_scale` float32 [N, K/G]: one scale per row and group of G consecutive inputs;
- `weight_zero_point` uint8 [N, K/G] (asymmetric formats), else the zero is 8.
w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]. Rows are output features, as in every other Heron
projection, so fused q/k/v and gate/up stack their rows (each part keeps its own scales) and tensor parallelism
splits rows (column-parallel) or whole groups of columns (row-parallel) without repacking.

Both kernels read a [BLOCK_N, BLOCK_K] tile as [BLOCK_N, BLOCK_K / 8] words, shift the 8 nibbles of each word
out along a third axis and view the tile as [BLOCK_N, TILE_GROUPS, BLOCK_K / TILE_GROUPS]: BLOCK_K is a
multiple of G (TILE_GROUPS groups a tile) or divides it (one group a tile), so each slice along the middle axis
has one scale and one zero per row.
- Up to `DECODE_ROWS` rows (`_gemv_kernel`): program (i, s) streams rows [i * BLOCK_N, (i + 1) * BLOCK_N) over
  its s-th share of K. One row (M == 1) runs on the CUDA cores: (q - zero) * x summed per group in float32,
  times the group's scale, summed into BLOCK_N float32 sums (the scale multiplies a group's sum, not each
  weight). More rows dequantize the tile to x's dtype and take tl.dot against x padded to 16 rows. Split-K
  (small N for the SM count) stores float32 partials that a sum after the kernel adds.
- More rows (`_dequantize_kernel`, then F.linear): the weight in x's dtype, then cuBLAS. On an H100 a
  dequantize-in-the-GEMM Triton kernel (mma tiles of 64-128 rows, the words repeated with tl.interleave) ran
  2.6-4.7x slower than bf16 cuBLAS from 32 rows up (`benchmarks/int4_probe.py`, 2026-12-05), while writing and
  re-reading the 16-bit weight costs about 4.5x the int4 bytes, a few tens of microseconds per projection.
  The 16-bit copy is transient (the allocator's; under a CUDA graph, the graph's pool).
Configs: `_config`, the one place to tune.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from heron.kernels.common import dot_upcast, num_sms

DECODE_ROWS = 16  # up to this many rows a call runs the GEMV


@triton.jit
def _dequantized_tile(
    w_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    n_mask,
    t,
    group_size,
    stride_wn,
    stride_sn,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
):
    """Tile t of K: (q - zero) [BLOCK_N, TILE_GROUPS, BLOCK_K / TILE_GROUPS] as float32 integers, and the
    slices' scales [BLOCK_N, TILE_GROUPS, 1]."""
    words = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + (t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :],
        mask=n_mask[:, None],
        other=0,
    )
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    q = tl.reshape((words[:, :, None] >> shifts) & 0xF, (BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS))
    g = (t * BLOCK_K + tl.arange(0, TILE_GROUPS) * (BLOCK_K // TILE_GROUPS)) // group_size
    sz = offs_n[:, None] * stride_sn + g[None, :]
    scale = tl.load(s_ptr + sz, mask=n_mask[:, None], other=0.0)[:, :, None]
    if HAS_ZEROS:
        zero = tl.load(z_ptr + sz, mask=n_mask[:, None], other=0).to(tl.int32)[:, :, None]
    else:
        zero = 8
    return (q - zero).to(tl.float32), scale


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FMA: tl.constexpr,  # one row on the CUDA cores, else tl.dot against x padded to 16 rows
    FP32: tl.constexpr,  # float32 operands for tl.dot
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    if FMA:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
        q, scale = _dequantized_tile(
            w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn,
            HAS_ZEROS, BLOCK_N, BLOCK_K, TILE_GROUPS,
        )  # fmt: skip
        if FMA:
            x = tl.load(x_ptr + t * BLOCK_K + offs_k).to(tl.float32)
            x = tl.reshape(x, (1, TILE_GROUPS, BLOCK_K // TILE_GROUPS))
            part = tl.sum(q * x, axis=2, keep_dims=True) * scale  # [BLOCK_N, TILE_GROUPS, 1]
            acc += tl.sum(tl.sum(part, axis=2), axis=1)
        else:
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + (t * BLOCK_K + offs_k)[None, :],
                mask=(offs_m < M)[:, None],
                other=0.0,
            )
            w = tl.reshape(q * scale, (BLOCK_N, BLOCK_K))
            if FP32:
                acc += tl.dot(w, tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(w.to(x.dtype), tl.trans(x))
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += b if FMA else b[:, None]
    out = out_ptr + pid_k * stride_os
    if FMA:
        tl.store(out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        ptrs = out + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m < M)[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    group_size,
    stride_wn,
    stride_sn,
    stride_on,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr,
):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    q, scale = _dequantized_tile(
        w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn,
        HAS_ZEROS, BLOCK_N, BLOCK_K, TILE_GROUPS,
    )  # fmt: skip
    w = tl.reshape(q * scale, (BLOCK_N, BLOCK_K))
    ptrs = out_ptr + offs_n[:, None] * stride_on + (t * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def _block_k(k: int, group_size: int, largest: int) -> int:
    """The largest power of two up to `largest` that divides K and is a multiple of G or divides it (16 always
    is: the loader checks that G is a multiple of 16 and divides K)."""
    b = largest
    while k % b or (group_size % b and b % group_size):
        b //= 2
    return b


def _config(m: int, n: int, k: int, group_size: int, device: torch.device) -> dict[str, int]:
    """One call's tiles. GEMV: 1024 weights a row a tile (512 bytes, as the 16-bit GEMV's best) with 8 rows a
    program for one row of x; 128 a row and 64 rows a program for tl.dot; K split until the grid fills the SMs
    about twice. Dequantize: [32, 256] tiles. Defaults, swept by `benchmarks/int4_probe.py --sweep`."""
    if m > DECODE_ROWS:
        block_k = _block_k(k, group_size, 256)
        return dict(BLOCK_N=32, BLOCK_K=block_k, num_warps=4)
    fma = m == 1
    block_n, block_k = (8, _block_k(k, group_size, 1024)) if fma else (64, _block_k(k, group_size, 128))
    tiles, k_tiles = triton.cdiv(n, block_n), k // block_k
    split = max(1, min(k_tiles, 2 * num_sms(device) // tiles))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, STAGES=4, num_warps=4)


def int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) in x's dtype (bf16, fp16 or fp32), float32 accumulation. K must be
    a multiple of the group size, itself a multiple of 16 (the loader checks both); the scales and zero points
    contiguous (the layer's parameters are)."""
    shape = x.shape
    k, n = shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_zeros(*shape[:-1], n)
    group_size = k // weight_scale.shape[1]
    cfg = _config(m, n, k, group_size, x.device)
    tile_groups = max(1, cfg["BLOCK_K"] // group_size)
    zeros = weight_scale if weight_zero_point is None else weight_zero_point
    has_zeros = weight_zero_point is not None
    if m > DECODE_ROWS:
        w = torch.empty(n, k, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), k // cfg["BLOCK_K"])
        _dequantize_kernel[grid](
            weight, weight_scale, zeros, w, n, group_size, weight.stride(0), weight_scale.stride(0), k,
            HAS_ZEROS=has_zeros, TILE_GROUPS=tile_groups, **cfg,
        )  # fmt: skip
        return F.linear(x2, w, bias).reshape(*shape[:-1], n)
    split = cfg["SPLIT_K"]
    out = torch.empty(
        (split, m, n) if split > 1 else (m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype
    )
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, weight, weight_scale, zeros, bias if bias is not None else weight_scale, out, m, n, k, group_size,
        x2.stride(0), weight.stride(0), weight_scale.stride(0), n, m * n,
        HAS_ZEROS=has_zeros, HAS_BIAS=bias is not None and split == 1, FMA=m == 1,
        FP32=x.dtype == torch.float32 or dot_upcast(), TILE_GROUPS=tile_groups, **cfg,
    )  # fmt: skip
    if split > 1:
        out = out.sum(0) if bias is None else out.sum(0) + bias
    return out.to(x.dtype).reshape(*shape[:-1], n)
