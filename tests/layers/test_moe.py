"""FusedMoE: what a token-by-token mixture of experts computes, from per-expert or stacked checkpoint matrices;
under tensor parallelism each rank holds its slice of every expert's intermediate dim, and the ranks' partial
sums add up to the whole layer's output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.distributed import parallel_state
from heron.kernels.reference import fused_experts_ref, topk_softmax_ref
from heron.layers.moe import FusedMoE

EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 16, 12


def _experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full per-expert gate [E, I, H], up [E, I, H], down [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(EXPERTS, INTER, HIDDEN, generator=gen),
        torch.randn(EXPERTS, INTER, HIDDEN, generator=gen),
        torch.randn(EXPERTS, HIDDEN, INTER, generator=gen),
    )


def _token_by_token(x, logits, gate, up, down, renormalize: bool) -> torch.Tensor:
    """The mixture as written in the papers, one token and one expert at a time."""
    out = torch.zeros_like(x)
    probs = logits.softmax(-1)
    for t in range(x.shape[0]):
        top = probs[t].topk(TOP_K)
        scale = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(scale, top.indices):
            out[t] += w * F.linear(F.silu(F.linear(x[t], gate[e])) * F.linear(x[t], up[e]), down[e])
    return out


def _load_per_expert(layer: FusedMoE, gate, up, down) -> None:
    for e in range(EXPERTS):
        layer.weight_loader(layer.w13_weight, gate[e], (e, 0))
        layer.weight_loader(layer.w13_weight, up[e], (e, 1))
        layer.weight_loader(layer.w2_weight, down[e], (e, 0))


@pytest.mark.parametrize("renormalize", [False, True])
def test_the_layer_computes_each_tokens_weighted_top_k_experts(renormalize):
    gate, up, down = _experts()
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize)
    _load_per_expert(layer, gate, up, down)
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(9, HIDDEN, generator=gen), torch.randn(9, EXPERTS, generator=gen)
    torch.testing.assert_close(layer(x, logits), _token_by_token(x, logits, gate, up, down, renormalize))


def test_stacked_and_per_expert_checkpoints_load_alike():
    gate, up, down = _experts()
    per_expert, stacked = (FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, True) for _ in range(2))
    _load_per_expert(per_expert, gate, up, down)
    stacked.weight_loader(stacked.w13_weight, torch.cat([gate, up], dim=1))  # transformers' [E, 2I, H]
    stacked.weight_loader(stacked.w2_weight, down)
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    assert torch.equal(stacked.w2_weight, per_expert.w2_weight)
    assert len(per_expert.shard_ids(per_expert.w13_weight)) == 2 * EXPERTS
    with pytest.raises(ValueError, match=r"has shape \(12, 15\), expected \(12, 16\)"):
        per_expert.weight_loader(per_expert.w13_weight, torch.zeros(INTER, HIDDEN - 1), (0, 0))
    with pytest.raises(ValueError, match="is expert 6, and the model has 6"):
        per_expert.weight_loader(per_expert.w2_weight, down[0], (EXPERTS, 0))


@pytest.mark.parametrize("renormalize", [False, True])
def test_each_rank_holds_its_slice_of_every_expert_and_the_partial_sums_add_up(monkeypatch, renormalize):
    """Two ranks' layers built and loaded side by side (the all-reduce between them: tests/models/
    test_tensor_parallel.py runs Qwen2-MoE over two gloo ranks)."""
    gate, up, down = _experts()
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(7, HIDDEN, generator=gen), torch.randn(7, EXPERTS, generator=gen)
    weights, ids = topk_softmax_ref(logits, TOP_K, renormalize)
    partials = []
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_rank", rank)
        monkeypatch.setattr(parallel_state, "_world_size", 2)
        layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize)
        assert layer.w13_weight.shape == (EXPERTS, INTER, HIDDEN) and layer.w2_weight.shape == (EXPERTS, HIDDEN, 6)
        _load_per_expert(layer, gate, up, down)
        local = slice(rank * 6, (rank + 1) * 6)
        assert torch.equal(layer.w13_weight, torch.cat([gate[:, local], up[:, local]], dim=1))
        assert torch.equal(layer.w2_weight, down[:, :, local])
        partials.append(fused_experts_ref(x, layer.w13_weight, layer.w2_weight, weights, ids))
    torch.testing.assert_close(sum(partials), _token_by_token(x, logits, gate, up, down, renormalize))
