"""Int4 weight-only (W4A16) matmuls: the weight dequantized inside the GEMM, in Triton.

The layout (every int4 checkpoint format is converted to it at load, heron/models/int4_formats.py):
- `weight` int32 [N, K/8]: row n's K unsigned nibbles, element 8w + j in bits 4j..4j+3 of word w;
- `weight_scale` float32 [N, K/G]: one scale per row and group of G consecutive inputs;
- `weight_zero_point` uint8 [N, K/G] (asymmetric formats), else the zero is 8.
w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]. Rows are output features, as in every other Heron
projection, so fused q/k/v and gate/up stack their rows (each part keeps its own scales) and tensor parallelism
splits rows (column-parallel) or whole groups of columns (row-parallel) without repacking.

Each program computes a [BLOCK_M, BLOCK_N] tile over its share of K in BLOCK_K steps, BLOCK_K dividing G. A
step loads each packed word once ([BLOCK_N, BLOCK_K / 8], contiguous along K), repeats it 8 times along K with
tl.interleave (vLLM's AWQ Triton kernel does the same along N) and shifts out one nibble per element; the
tile's integers minus the zero are exact in the activation's dtype, the dot accumulates in float32 and the
group's scale multiplies the partial product (one multiply per output, not per weight). At decode sizes (at most
16 rows) there are few output tiles, so K is split over SPLIT_K programs whose float32 partial sums are added
after (no atomics: graph-safe, deterministic). The configurations live in `_config`, the one place to tune.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import dot_upcast

DECODE_ROWS = 16  # up to this many rows a call is a decode step: split K
_DECODE_PROGRAMS = 256  # programs a decode call aims for (about two per SM on an H200's 132)


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


def _config(m: int, n: int, k: int, group_size: int) -> dict[str, int]:
    """Tile sizes and split-K for one call: BLOCK_K the largest of 128..16 dividing the group; a decode call
    splits K until the grid has about `_DECODE_PROGRAMS` programs. Defaults, not yet tuned on the H200."""
    block_k = next(b for b in (128, 64, 32, 16) if group_size % b == 0)
    if m <= DECODE_ROWS:
        block_m, block_n = 16, 64
        n_tiles, k_tiles = triton.cdiv(n, block_n), k // block_k
        split_k = max(1, min(k_tiles, _DECODE_PROGRAMS // n_tiles))
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=3)
    block_m = 64 if m <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k, SPLIT_K=1, num_warps=8, num_stages=3)


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
    cfg = _config(m, n, k, group_size)
    split = cfg["SPLIT_K"]
    out = torch.empty(
        (split, m, n) if split > 1 else (m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype
    )
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _w4a16_kernel[grid](
        x2,
        weight,
        weight_scale,
        weight_scale if weight_zero_point is None else weight_zero_point,
        out,
        m,
        n,
        k,
        group_size,
        x2.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        n,
        m * n,
        HAS_ZEROS=weight_zero_point is not None,
        FP32=x.dtype == torch.float32 or dot_upcast(),  # float32 operands under the interpreter (common.py)
        **cfg,
    )
    y = out.sum(0) if split > 1 else out
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*shape[:-1], n)
