"""Int4 weight-only (W4A16) matmuls: the weight dequantized inside the kernel up to 16 rows, by a kernel of its
own before cuBLAS past them.

The layout (every int4 checkpoint format is converted to it at load, heron/models/int4_formats.py):
- `weight` int32 [N, K/8]: row n's K unsigned nibbles, element 8w + j in bits 4j..4j+3 of word w;
- `weight_scale` float32 [N, K/G]: one scale per row and group of G consecutive inputs;
- `weight_zero_point` uint8 [N, K/G] (asymmetric formats), else the zero is 8.
w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]. Rows are output features, as in every other Heron
projection, so fused q/k/v and gate/up stack their rows (each part keeps its own scales) and tensor parallelism
splits rows (column-parallel) or whole groups of columns (row-parallel) without repacking.

Three kernels, by the number of rows M (the choice is `_config`'s, the one place to tune):
- M == 1, `_gemv_kernel` on the CUDA cores: program (i, s) streams rows [i * BLOCK_N, (i + 1) * BLOCK_N) over
  its s-th share of K. `_tile_codes` reads a tile as [BLOCK_N, BLOCK_K / 8] words, shifts each word's 8
  nibbles out along a third axis and views the tile as [BLOCK_N, TILE_GROUPS, BLOCK_K / TILE_GROUPS] (BLOCK_K
  a multiple of G, or dividing it: one scale and zero per row and slice); q * x is summed per slice in
  float32, less zero * the slice's sum of x, then times the slice's scale. The kernel is bound by its
  instructions, not by DRAM: under Nsight Compute (`gpu_check.sh ncu-gemv`, H100) Llama-3.1-8B's gate_up read
  at 43% of DRAM's throughput with the ALU pipe (integer and logic: the nibbles' shifts, masks) 58% busy, issue
  slots 67% busy, where the float8 and bf16 GEMVs read at 81% and 88%.
- 2 <= M <= 16, `_w4a16_kernel`: [16, BLOCK_N] tiles on tensor cores. A step loads each packed word once
  ([BLOCK_N, BLOCK_K / 8]), repeats it 8 times along K with tl.interleave and shifts out one nibble per
  element; the integers minus the zero are exact in the activation's dtype, the dot accumulates in float32
  and the group's scale multiplies the partial product (BLOCK_K divides G). K is split over SPLIT_K programs.
- M > 16, `_dequantize_kernel` then F.linear: the weight in x's dtype, then cuBLAS. The 16-bit copy is
  transient (the allocator's; under a CUDA graph, the graph's pool).
Split-K stores float32 partials that a sum after the kernel adds (no atomics: graph-safe, deterministic).

Measured on an H100 (`benchmarks/int4_probe.py`, Llama-3.1-8B's projections, groups of 128 with zeros, a decode
step's matmuls over 32 layers, 2026-12-05): at one row the GEMV takes 3.00 ms (6ac55af; 3.18 with the zero
subtracted per weight) where the tensor-core kernel took 5.28 (bf16 cuBLAS: 5.32-5.37); past 16 rows
dequantize-then-cuBLAS beats the tensor-core kernel at every size (32 rows: 12.2 against 14.8 ms; 256: 13.5
against 29.9; 2048: 41.7 against 154.6; bf16 5.5, 6.5, 36.0). Tried and slower: the GEMV's tile as [rows, words,
8] without the reshape, nibbles turned into floats through the mantissa of 2^23 (13.6 ms at one row), and a tl.dot
form of the GEMV for 2-16 rows (17 ms); no faster: those mantissa floats in this kernel (within 0.8 us of the
conversion on every projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from heron.kernels.common import dot_upcast, num_sms

DECODE_ROWS = 16  # up to this many rows the weight is dequantized inside the kernel
_DECODE_PROGRAMS = 256  # programs a 2-16-row call aims for (about two per SM on an H200's 132)


@triton.jit
def _tile_codes(
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
    """Tile t of K: the nibbles q [BLOCK_N, TILE_GROUPS, BLOCK_K / TILE_GROUPS] as int32, and the slices'
    scales and zeros [BLOCK_N, TILE_GROUPS, 1]."""
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
        zero = tl.full((BLOCK_N, TILE_GROUPS, 1), 8, tl.int32)
    return q, scale, zero


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    group_size,
    stride_wn,
    stride_sn,
    stride_os,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in tl.range(pid_k, K // BLOCK_K, SPLIT_K, num_stages=STAGES):
        q, scale, zero = _tile_codes(
            w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn,
            HAS_ZEROS, BLOCK_N, BLOCK_K, TILE_GROUPS,
        )  # fmt: skip
        x = tl.load(x_ptr + t * BLOCK_K + offs_k).to(tl.float32)
        x = tl.reshape(x, (1, TILE_GROUPS, BLOCK_K // TILE_GROUPS))
        # sum (q - zero) * x = sum q * x - zero * sum x: the zero once per slice, not once per weight
        qx = tl.sum(q.to(tl.float32) * x, axis=2, keep_dims=True)
        part = (qx - zero.to(tl.float32) * tl.sum(x, axis=2, keep_dims=True)) * scale  # [BLOCK_N, TILE_GROUPS, 1]
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_k * stride_os + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
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
    FP32: tl.constexpr,  # float32 operands, full-precision dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = ((offs_k % 8) * 4)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k = t * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
        # each word once ([BLOCK_N, BLOCK_K / 8], contiguous along K), then repeated 8 times along K
        words = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + (t * (BLOCK_K // 8) + offs_w)[None, :], mask=n_mask[:, None], other=0
        )
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        q = tl.trans((words >> shifts) & 0xF)  # [BLOCK_K, BLOCK_N]
        g = (t * BLOCK_K) // group_size
        scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        if HAS_ZEROS:
            q = q - tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.int32)[None, :]
        else:
            q = q - 8
        if FP32:
            part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, q.to(x.dtype))
        acc += part * scale[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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
    q, scale, zero = _tile_codes(
        w_ptr, s_ptr, z_ptr, offs_n, n_mask, t, group_size, stride_wn, stride_sn,
        HAS_ZEROS, BLOCK_N, BLOCK_K, TILE_GROUPS,
    )  # fmt: skip
    w = tl.reshape((q - zero).to(tl.float32) * scale, (BLOCK_N, BLOCK_K))
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
    """One call's kernel configuration. One row: 2048 inputs (1 KiB) a row a tile, 8 rows a program (the best of
    the H100 sweep), K split only where the row tiles would not fill the SMs twice. 2-16 rows:
    BLOCK_K the largest of 128..16 dividing the group, [16, 64] tiles, K split until the grid holds about
    `_DECODE_PROGRAMS` programs. Past 16 rows: dequantize in [32, 256] tiles."""
    if m == 1:
        block_n, block_k = 8, _block_k(k, group_size, 2048)
        split = max(1, min(k // block_k, 2 * num_sms(device) // triton.cdiv(n, block_n)))
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, STAGES=4, num_warps=4)
    if m <= DECODE_ROWS:
        block_k = next(b for b in (128, 64, 32, 16) if group_size % b == 0)
        n_tiles, k_tiles = triton.cdiv(n, 64), k // block_k
        split_k = max(1, min(k_tiles, _DECODE_PROGRAMS // n_tiles))
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, BLOCK_K=_block_k(k, group_size, 256), num_warps=4)


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
    tile_groups = max(1, cfg["BLOCK_K"] // group_size)  # (the GEMV's and the dequantize kernel's tiles)
    if m > DECODE_ROWS:
        w = torch.empty(n, k, device=x.device, dtype=x.dtype)
        _dequantize_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), k // cfg["BLOCK_K"])](
            weight, weight_scale, zeros, w, n, group_size, weight.stride(0), weight_scale.stride(0), k,
            HAS_ZEROS=has_zeros, TILE_GROUPS=tile_groups, **cfg,
        )  # fmt: skip
        return F.linear(x2, w, bias).reshape(*shape[:-1], n)
    split = cfg["SPLIT_K"]
    out = torch.empty(
        (split, m, n) if split > 1 else (m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype
    )
    bias_in_kernel = m == 1 and split == 1
    if m == 1:
        _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x2, weight, weight_scale, zeros, bias if bias is not None else weight_scale, out, n, k, group_size,
            weight.stride(0), weight_scale.stride(0), n,
            HAS_ZEROS=has_zeros, HAS_BIAS=bias is not None and bias_in_kernel,
            TILE_GROUPS=tile_groups, **cfg,
        )  # fmt: skip
    else:
        _w4a16_kernel[(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x2, weight, weight_scale, zeros, out, m, n, k, group_size, x2.stride(0), weight.stride(0),
            weight_scale.stride(0), n, m * n,
            HAS_ZEROS=has_zeros, FP32=x.dtype == torch.float32 or dot_upcast(), **cfg,  # fp32 operands off the GPU
        )  # fmt: skip
    y = out.sum(0) if split > 1 else out
    if bias is not None and not bias_in_kernel:
        y = y + bias
    return y.to(x.dtype).reshape(*shape[:-1], n)
