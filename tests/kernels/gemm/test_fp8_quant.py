"""The per-token FP8 quantization kernel (heron/kernels/gemm/fp8_quant.py) against its PyTorch reference, bit for
bit, on CUDA or under Triton's interpreter on the CPU: rows wider than one tile, an all-zero row, rows of very
different magnitudes, leading dimensions, a row-strided view."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from heron.kernels.gemm.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8_rows_ref
from heron.kernels.gemm.fp8_quant import quantize_fp8_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = (FP8_DTYPE, FP8_MAX, MIN_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 2500])  # one masked tile; three tiles, the last partial
def test_quantize_rows_equals_the_reference(dtype, k):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(2, 3, k, generator=gen) * torch.logspace(-4, 4, 3)[:, None]).to(dtype)
    x[1, 1] = 0.0
    q, scale = quantize_fp8_rows_triton(x.to(DEVICE), *FP8)
    want_q, want_scale = quantize_fp8_rows_ref(x)
    assert q.shape == x.shape and scale.shape == (2, 3, 1)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_rows_of_a_strided_view():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    view = x[:, :32]  # rows 64 apart
    q, scale = quantize_fp8_rows_triton(view.to(DEVICE), *FP8)
    want_q, want_scale = quantize_fp8_rows_ref(view)
    assert torch.equal(scale.cpu(), want_scale) and torch.equal(q.cpu().float(), want_q.float())
