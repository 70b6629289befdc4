"""The FP8 matmul (heron/kernels/gemm/fp8.py) against its dequantize-then-matmul reference, on the CPU
(`torch._scaled_mm` runs there too) and, where there is one, on CUDA.

Tolerances: both paths multiply the same float8 operands, so they differ only in summation order (float32
accumulation: 1e-5 relative to the output's scale on the CPU; on CUDA the bf16 output's rounding, 1e-2). Against
the full-precision product the error is e4m3's: each operand rounds to 3 mantissa bits (<= 2^-4 relative per
element), ~3-4% relative (Frobenius) on Gaussian data; asserted below 6%.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.kernels.gemm.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear, quantize_fp8_rows
from heron.kernels.reference import fp8_linear_ref


def _cpu_scales_per_row() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row (2.13 does; 2.11, the GPU image's, only one
    per tensor): the CPU cases need it."""
    ones = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


CPU_ROWS = _cpu_scales_per_row()
DEVICES = (["cpu"] if CPU_ROWS else []) + (["cuda"] if torch.cuda.is_available() else [])


def test_quantize_rows_error_bound_and_range():
    torch.manual_seed(0)
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[3] = 0.0  # an all-zero row keeps a finite scale
    q, scale = quantize_fp8_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (7, 1) and torch.isfinite(scale).all()
    deq = q.float() * scale
    # 3 mantissa bits: half an ulp of 2^-3 relative for normal values; subnormals (below 2^-6) absolute 2^-10
    assert ((deq - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale).all()
    nonzero = torch.arange(7) != 3
    assert (q.float().abs().amax(1)[nonzero] == FP8_MAX).all()
    assert (deq[3] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_dequantized_reference(device, m, bias):
    torch.manual_seed(m)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, k = 80, 112
    w = torch.randn(n, k, device=device)
    wq, w_scale = quantize_fp8_rows(w)
    x = torch.randn(m, k, device=device, dtype=dtype) * 3
    b = torch.randn(n, device=device, dtype=dtype) if bias else None
    y = fp8_linear(x, wq, b, weight_scale=w_scale)
    ref = fp8_linear_ref(x, wq, b, weight_scale=w_scale)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-2 if device == "cuda" else 1e-5
    assert (y.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    exact = F.linear(x.float(), w, None if b is None else b.float())
    assert (y.float() - exact).norm() / exact.norm() < 0.06


@pytest.mark.skipif(not CPU_ROWS, reason="this torch's CPU _scaled_mm takes per-tensor scales only")
def test_fp8_linear_keeps_leading_dims_and_per_tensor_scales():
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    s = w.abs().max() / FP8_MAX  # a per-tensor scale, stored on every row
    wq, w_scale = (w / s).to(FP8_DTYPE), s.reshape(1, 1).expand(48, 1).contiguous()
    x = torch.randn(2, 3, 64)
    y = fp8_linear(x, wq, weight_scale=w_scale)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, fp8_linear_ref(x, wq, weight_scale=w_scale), rtol=1e-5, atol=1e-5)
