"""The decode MoE GEMVs (heron/kernels/moe_gemv.py) against the PyTorch reference of routing + experts. On CPU
under Triton's interpreter with tiny shapes (tiles past the rows, K not a multiple of BLOCK_K, tokens that share
an expert, k = 1); on CUDA Qwen3-30B-A3B's experts with the default configs."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from heron.kernels.moe_gemv import GemvMoeConfig, _down_kernel, default_config, moe_gemv
from heron.kernels.reference import fused_moe_ref
from tests.kernels.kernel_utils import pick_device, rel_err, skip_unless_runnable

DEVICE = pick_device()
skip_unless_runnable(_down_kernel, DEVICE)

# dtype -> relative Frobenius error: the kernels round where the reference does, so bf16 differs only where a
# float32 sum in another order rounds to the next bf16 value
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}

# tokens, hidden, inter, experts, k, renormalize, (first kernel's config, second's) or None for the defaults
CASES = {
    "one-token": (1, 64, 48, 8, 2, True, None),
    "uneven": (3, 40, 24, 6, 3, False, (GemvMoeConfig(8, 16), GemvMoeConfig(16, 16, num_stages=2))),
    "k-1": (2, 32, 32, 4, 1, False, (GemvMoeConfig(16, 32), GemvMoeConfig(8, 8))),
}


def _experts(tokens, hidden, inter, num_experts, dtype, gen):
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    return x, w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_gemv_routes_and_computes_like_the_reference(dtype, case):
    tokens, hidden, inter, num_experts, top_k, renormalize, configs = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x, w13, w2 = _experts(tokens, hidden, inter, num_experts, dtype, gen)
    logits = torch.randn(tokens, num_experts, generator=gen).to(DEVICE, dtype)
    logits[-1, 1] = logits[-1, 0]  # a tie: the lower index wins, as in the reference
    out = moe_gemv(x, logits, w13, w2, top_k, renormalize, configs=configs)
    ref = fused_moe_ref(x, logits, w13, w2, top_k, renormalize)
    assert out.shape == ref.shape and out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype], f"{case} {dtype}: relative error {rel_err(out, ref):.3g}"


def test_tokens_sharing_experts_each_get_their_own_rows():
    """Every token routed to the same k experts (the act rows are per entry, not per expert)."""
    gen = torch.Generator().manual_seed(1)
    x, w13, w2 = _experts(3, 32, 16, 8, torch.float32, gen)
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[:, 5], logits[:, 2] = 3.0, 2.0
    out = moe_gemv(x, logits, w13, w2, 2, renormalize=True)
    torch.testing.assert_close(out, fused_moe_ref(x, logits, w13, w2, 2, True), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[0], out[1])


def test_no_tokens_give_an_empty_output():
    x, w13, w2 = _experts(0, 32, 16, 4, torch.float32, torch.Generator().manual_seed(0))
    assert moe_gemv(x, torch.zeros(0, 4, device=DEVICE), w13, w2, 2, True).shape == (0, 32)


def test_default_configs_tile_rows_whole_and_keep_small_weights_in_many_programs():
    assert default_config(768, 2048, 2) == GemvMoeConfig(8, 256, num_warps=2, num_stages=4)  # Qwen3-30B-A3B
    assert default_config(2048, 768, 2) == GemvMoeConfig(4, 256, num_warps=2, num_stages=4)  # its down
    assert default_config(2048, 1408, 2).block_k == 128  # Qwen2-MoE's down: 1408 = 11 x 128
    assert default_config(64, 40, 4).block_k == 32  # 40 has no power-of-two tile: the least, 128 bytes
    assert default_config(64, 16, 2).block_k == 16  # no wider than the row


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4])
def test_qwen3_30b_shapes_with_the_default_configs(tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, w13, w2 = _experts(tokens, 2048, 768, 128, torch.bfloat16, gen)
    logits = torch.randn(tokens, 128, generator=gen).to(DEVICE, torch.bfloat16)
    out = moe_gemv(x, logits, w13, w2, 8, renormalize=True)
    ref = fused_moe_ref(x, logits, w13, w2, 8, True)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
