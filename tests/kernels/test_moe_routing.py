"""The router's top-k (heron/kernels/moe_routing.py) against the PyTorch reference: the same experts, ties to
the lower index, the same weights."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from heron.kernels.moe_routing import _topk_softmax_kernel, topk_softmax
from heron.kernels.reference import topk_softmax_ref
from tests.kernels.kernel_utils import pick_device, skip_unless_runnable

DEVICE = pick_device()
skip_unless_runnable(_topk_softmax_kernel, DEVICE)


@pytest.mark.parametrize("tokens, num_experts, top_k", [(9, 6, 1), (9, 6, 3), (5, 16, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_picks_and_weighs_like_the_reference(tokens, num_experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(tokens * num_experts + top_k)
    logits = torch.randn(tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_w, ref_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens, device=DEVICE))


def test_ties_go_to_the_lower_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]], device=DEVICE)
    _, ids = topk_softmax(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 2]]
