"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (a bias on q/k/v) with Mixtral's sparse MLP plus a
shared expert: a dense SwiGLU MLP every token goes through, scaled by sigmoid(shared_expert_gate(x)), a scalar per
token, and added to the routed experts' sum. The top-k weights are renormalised only where `norm_topk_prob` says
(off in the released models); `mlp_only_layers` and `decoder_sparse_step` choose dense layers (`MoeConfig`)."""

from __future__ import annotations

import torch
from torch import nn

from heron.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from heron.models.config import TransformerConfig
from heron.models.mixtral import MixtralForCausalLM, SparseMoeBlock


class Qwen2MoeMLP(nn.Module):
    """A SwiGLU MLP on the normed hidden states (the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, swiglu=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg)
        self.shared_expert = Qwen2MoeMLP(cfg.hidden_size, cfg.moe.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, router_logits) + shared


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    sparse_block = Qwen2MoeSparseMoeBlock
