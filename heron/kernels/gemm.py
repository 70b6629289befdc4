"""y = x @ W^T for 17..256 rows of x on Hopper: TMA loads, optionally warp-specialised (a producer warp
issues the copies, the consumer warpgroups only run wgmma), optionally with A and B swapped (W as wgmma's
M side, x's rows as its N side: 64-row W tiles, x tiles of 16..256 rows).

Experimental (session 5): timed against cuBLAS by `python -m heron.kernels.bench --gemv --rows ...`; the
engine does not call it yet."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows of x per tile
    block_n: int  # rows of W (output columns) per tile
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 4
    swap: bool = False  # W tile as wgmma's A (M side), x tile as its B
    warp_specialize: bool = True


@triton.jit
def _gemm_kernel(x_desc, w_desc, out_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SWAP: tl.constexpr, WS: tl.constexpr):
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % m_tiles  # row tiles fastest: one W slab read from HBM once
    pid_n = tl.program_id(0) // m_tiles
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if SWAP:
        out_desc.store([off_m, off_n], acc.T.to(out_desc.dtype))
    else:
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight) for x [M, K] (contiguous rows), weight [N, K] contiguous, 16-bit."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    c = config
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [c.block_m, c.block_k])
    w_desc = TensorDescriptor(weight, [n, k], [k, 1], [c.block_n, c.block_k])
    o_desc = TensorDescriptor(out, [m, n], [n, 1], [c.block_m, c.block_n])
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _gemm_kernel[grid](x_desc, w_desc, o_desc, m, n, k, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       STAGES=c.num_stages, SWAP=c.swap, WS=c.warp_specialize, num_warps=c.num_warps,
                       num_stages=c.num_stages)
    return out
