"""Per-token FP8 quantization of a W8A8 matmul's activations in one kernel: each row of x scaled so that its
absolute max maps to 448, rounded to e4m3, and its float32 scale.

As PyTorch ops (`quantize_fp8_rows_ref`, what the CPU runs) it is seven kernels over x (float, abs, amax, two
divisions, clamp, cast), each reading and most writing a float32 copy of it: at a prefill step's 8,192 rows
that traffic costs about as much as the FP8 GEMM it feeds. Here program r reads row r twice (the second
pass mostly from cache) and writes only the float8 row and its scale. The divisions are IEEE-rounded
(`div_rn`), as PyTorch's, and the cast rounds to nearest even (`to_fp8`), so the result is the reference's bit
for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import interpreting, to_fp8

BLOCK_K = 1024


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    QMAX: tl.constexpr,
    MIN_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FIX_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), MIN_S)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        tl.store(q_row + ks, to_fp8(tl.math.div_rn(x, scale), 1.0, q_ptr, FIX_FP8), mask=ks < K)


def quantize_fp8_rows_triton(
    x: torch.Tensor, dtype: torch.dtype, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [..., K] of float8 `dtype`, scale float32 [..., 1]) with x ~= xq * scale, each row's absolute max
    mapped to `fp8_max`, the scale at least `min_scale`: fp8.py's `quantize_fp8_rows_ref` (whose constants
    fp8.py passes)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](
            x2,
            q,
            scale,
            k,
            x2.stride(0),
            k,
            QMAX=fp8_max,
            MIN_S=min_scale,
            BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)),
            FIX_FP8=interpreting(),
        )
    return q, scale
