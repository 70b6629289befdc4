"""Int4 weight-only (W4A16) matmuls: a GEMV that dequantizes on load for decode batches, and a dequantize
kernel before cuBLAS for larger ones.

The layout (every int4 checkpoint format is converted to it at load, heron/models/int4_formats.py):
- `weight` int32 [N, K/8]: row n's K unsigned nibbles, element 8w + j in bits 4j..4j+3 of word w;
- `weight_scale` float32 [N, K/G]: one scale per row and group of G consecutive inputs;
- `weight_zero_point` uint8 [N, K/G] (asymmetric formats), else the zero is 8.
w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]. Rows are output features, as in every other Heron
projection, so fused q/k/v and gate/up stack their rows (each part keeps its own scales) and tensor parallelism
splits rows (column-parallel) or whole groups of columns (row-parallel) without repacking.

Both kernels read a tile of BLOCK_N rows and BLOCK_K inputs as [BLOCK_N, BLOCK_K / 8] words and shift each
word's 8 nibbles out along a third axis (`_dequantized_tile`); each word lies in one group, whose scale and zero
it loads (BLOCK_K is a power of two dividing K, so a tile may span groups, or lie inside one).
- Up to `DECODE_ROWS` rows (`_gemv_kernel`): program (i, s) streams rows [i * BLOCK_N, (i + 1) * BLOCK_N) over
  its s-th share of K on the CUDA cores. The tile is dequantized once for all rows of x: (q - zero) * x summed
  per word in float32, times the word's scale, summed into BLOCK_N float32 sums per row. Split-K (few output
  tiles for the SM count) stores float32 partials that a sum after the kernel adds.
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

from heron.kernels.common import num_sms

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
):
    """Tile t of K: q - zero as float32 [BLOCK_N, BLOCK_K / 8, 8] (word, nibble), and each word's scale
    [BLOCK_N, BLOCK_K / 8]. A nibble becomes a float without a conversion instruction (a quarter of the FMA
    rate on Hopper, which bound a first version): OR-ed into the mantissa of 2^23 it is the float 2^23 + q, and
    one subtraction of 2^23 + zero leaves q - zero exactly."""
    offs_w = t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=n_mask[:, None], other=0)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    magic = (((words[:, :, None] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    sz = offs_n[:, None] * stride_sn + (offs_w * 8 // group_size)[None, :]  # each word's group
    scale = tl.load(s_ptr + sz, mask=n_mask[:, None], other=0.0)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + sz, mask=n_mask[:, None], other=0).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N, BLOCK_K // 8), 8.0, tl.float32)
    return magic - (zero + 8388608.0)[:, :, None], scale


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
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, ROWS)
    x_offs = (tl.arange(0, BLOCK_K // 8) * 8)[:, None] + tl.arange(0, 8)[None, :]  # [words, nibbles]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
        w, scale = _dequantized_tile(
            w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn, HAS_ZEROS, BLOCK_N, BLOCK_K
        )
        for m in tl.static_range(ROWS):  # the tile is dequantized once for all rows
            x = tl.load(x_ptr + m * stride_xm + t * BLOCK_K + x_offs, mask=m < M, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(w * x[None, :, :], axis=2) * scale, axis=1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & n_mask[None, :])


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
):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w, scale = _dequantized_tile(
        w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn, HAS_ZEROS, BLOCK_N, BLOCK_K
    )
    k = t * BLOCK_K + (tl.arange(0, BLOCK_K // 8) * 8)[:, None] + tl.arange(0, 8)[None, :]
    ptrs = out_ptr + offs_n[:, None, None] * stride_on + k[None, :, :]
    tl.store(ptrs, (w * scale[:, :, None]).to(out_ptr.dtype.element_ty), mask=n_mask[:, None, None])


def _block_k(k: int, largest: int) -> int:
    """The largest power of two up to `largest` that divides K (16 always does: the loader checks that the
    group size is a multiple of 16 and divides K)."""
    b = largest
    while k % b:
        b //= 2
    return b


def _config(m: int, n: int, k: int, group_size: int, device: torch.device) -> dict[str, int]:
    """One call's tiles. GEMV: 2048 weights (1 KiB) a row a tile with 8 rows a program for one row of x, 512
    for more rows (the dequantized tile stays in registers across them); K split until the grid fills the SMs
    about twice. Dequantize: [32, 256] tiles. `benchmarks/int4_probe.py --sweep` times others."""
    if m > DECODE_ROWS:
        return dict(BLOCK_N=32, BLOCK_K=_block_k(k, 256), num_warps=4)
    block_n, block_k = 8, _block_k(k, 2048 if m == 1 else 512)
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(k // block_k, 2 * num_sms(device) // tiles))
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
    zeros = weight_scale if weight_zero_point is None else weight_zero_point
    has_zeros = weight_zero_point is not None
    if m > DECODE_ROWS:
        w = torch.empty(n, k, device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), k // cfg["BLOCK_K"])
        _dequantize_kernel[grid](
            weight, weight_scale, zeros, w, n, group_size, weight.stride(0), weight_scale.stride(0), k,
            HAS_ZEROS=has_zeros, **cfg,
        )  # fmt: skip
        return F.linear(x2, w, bias).reshape(*shape[:-1], n)
    split = cfg["SPLIT_K"]
    out = torch.empty(
        (split, m, n) if split > 1 else (m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype
    )
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, weight, weight_scale, zeros, bias if bias is not None else weight_scale, out, m, n, k, group_size,
        x2.stride(0), weight.stride(0), weight_scale.stride(0), n, m * n,
        HAS_ZEROS=has_zeros, HAS_BIAS=bias is not None and split == 1, ROWS=triton.next_power_of_2(m), **cfg,
    )  # fmt: skip
    if split > 1:
        out = out.sum(0) if bias is None else out.sum(0) + bias
    return out.to(x.dtype).reshape(*shape[:-1], n)
