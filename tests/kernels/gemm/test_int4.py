"""The W4A16 GEMM (heron/kernels/gemm/int4.py) against its dequantize-then-matmul reference
(`int4_linear_ref`), on CUDA or under Triton's interpreter on the CPU; and the packing helpers against each other.

Tolerances: kernel and reference multiply the same dequantized weights, so they differ in summation order and,
in bf16, in where the rounding happens (the reference rounds the float32 product once; the kernel multiplies
exact integer weights by bf16 activations, accumulates in float32 and scales per group): float32 1e-5, bf16 /
fp16 2e-2 of the output's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from heron.kernels.gemm.int4 import int4_linear
from heron.kernels.reference import dequantize_int4, int4_linear_ref, pack_int4, unpack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pack_unpack_round_trip_and_awq_order():
    q = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4)
    assert torch.equal(unpack_int4(packed), q)
    assert (packed < 0).any() or (q[:, 7::8] < 8).all()  # the top nibble sets the sign bit
    # AWQ's word holds columns [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7; its reverse order reads them back
    awq = pack_int4(q.view(3, 4, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]].reshape(3, 32))
    assert torch.equal(unpack_int4(awq, order=[0, 4, 1, 5, 2, 6, 3, 7]), q)


@pytest.mark.parametrize("m", [1, 7, 64])  # the GEMV (1), the tensor-core kernel (7), dequantize then matmul (64)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dequantized_reference(m, group, zeros, dtype):
    torch.manual_seed(m * group + zeros)
    n, k = 48, 256  # N not a multiple of the tile: the masked edge
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // group) * 0.02 + 0.005
    zero = torch.randint(0, 16, (n, k // group), dtype=torch.uint8) if zeros else None
    weight = pack_int4(q)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    args = dict(weight_scale=scale.to(DEVICE), weight_zero_point=None if zero is None else zero.to(DEVICE))
    y = int4_linear(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), **args).cpu()
    ref = int4_linear_ref(x, weight, bias, weight_scale=scale, weight_zero_point=zero)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.float() @ dequantize_int4(weight, scale, zero).t() + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.float() - exact).abs().max() <= tol * exact.abs().max()
    assert (ref.float() - exact).abs().max() <= tol * exact.abs().max()


@pytest.mark.parametrize(
    "m, n, k, group",
    [(1, 16, 2048, 128), (1, 24, 384, 384), (3, 24, 384, 384), (20, 24, 384, 384)],
    ids=["split-k", "per-channel", "3-rows-per-channel", "dequantize-per-channel"],
)
def test_int4_linear_tiles_split_k_and_one_group_per_row(m, n, k, group):
    """K split over programs (few rows for the SMs), and a group as long as K (GPTQ's group_size -1) that is no
    power of two: a tile then sits inside the group."""
    torch.manual_seed(k + m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, zero = torch.rand(n, k // group) * 0.02 + 0.005, torch.randint(0, 16, (n, k // group), dtype=torch.uint8)
    x, bias = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    args = dict(weight_scale=scale.to(DEVICE), weight_zero_point=zero.to(DEVICE))
    y = int4_linear(x.to(DEVICE), pack_int4(q).to(DEVICE), bias.to(DEVICE), **args).cpu()
    exact = x.float() @ dequantize_int4(pack_int4(q), scale, zero).t() + bias.float()
    assert (y.float() - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_int4_linear_keeps_leading_dims_in_float16():
    torch.manual_seed(0)
    weight = pack_int4(torch.randint(0, 16, (32, 64), dtype=torch.uint8))
    scale = torch.rand(32, 2) * 0.01
    x = torch.randn(2, 3, 64, dtype=torch.float16)
    y = int4_linear(x.to(DEVICE), weight.to(DEVICE), weight_scale=scale.to(DEVICE)).cpu()
    assert y.shape == (2, 3, 32) and y.dtype == torch.float16
    torch.testing.assert_close(y, int4_linear_ref(x, weight, weight_scale=scale), rtol=2e-3, atol=2e-3)
