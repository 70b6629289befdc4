"""Mixtral (Jiang et al., "Mixtral of Experts", 2024): the Llama block with its MLP replaced by a sparse mixture of
experts. A router (a linear layer, `gate`) scores each token against the E experts, each a SwiGLU MLP; the token
goes through its top k (2 of 8) and their outputs are summed, weighted by the router's softmax renormalised over
those k. Every layer's MLP is sparse. Qwen3-MoE and Qwen2-MoE are this block with other switches (their files).

The experts of a layer are one `FusedMoE` (heron/layers/moe.py): stacked weights, routed and computed by one
grouped GEMM per projection on CUDA. `load_weights` stacks the checkpoint's per-expert matrices into them
(`experts.{e}.w1` / `w3` / `w2`, or Qwen's `gate_proj` / `up_proj` / `down_proj`), or takes transformers' own
stacked `experts.gate_up_proj` / `experts.down_proj` whole; Mixtral checkpoints name the block
`block_sparse_moe`, read here as `mlp`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from heron.attention import AttentionBackend, AttentionMetadata
from heron.layers.layernorm import LinearNormLinear, NormLinear
from heron.layers.linear import ReplicatedLinear
from heron.layers.moe import FusedMoE
from heron.layers.rotary import RotaryEmbedding
from heron.models.config import TransformerConfig
from heron.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

# a checkpoint's matrix of one expert: (parameter, part) by its name
EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = {
    "w1": ("w13_weight", 0),
    "gate_proj": ("w13_weight", 0),
    "w3": ("w13_weight", 1),
    "up_proj": ("w13_weight", 1),
    "w2": ("w2_weight", 0),
    "down_proj": ("w2_weight", 0),
}
STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # transformers' [E, 2I, H] and [E, H, I]


class SparseMoeBlock(nn.Module):
    """The router and the routed experts: x [T, H] (normed) -> sum over each token's top-k experts."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, moe.renormalize)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states, router_logits: self.gate's of them (run with the norm before)."""
        return self.experts(x, router_logits)


class MoeDecoderLayer(nn.Module):
    """The Llama layer with a sparse MLP: the attention's output projection, the post-attention norm and the router
    run as one op (`LinearNormLinear`, one kernel at batch 1), whose normed rows and logits go to the experts."""

    def __init__(
        self, cfg: TransformerConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int, mlp: nn.Module
    ):
        super().__init__()
        attn = LlamaAttention(cfg, rope, backend, layer)
        self.input_layernorm = NormLinear(cfg.hidden_size, cfg.rms_norm_eps, attn.qkv_proj)
        self.self_attn = attn
        self.post_attention_layernorm = LinearNormLinear(cfg.hidden_size, cfg.rms_norm_eps, attn.o_proj, mlp.gate)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.input_layernorm(x, residual)
        attended = self.self_attn.attend(positions, qkv, meta)
        router_logits, x, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(x, router_logits), residual


class MixtralForCausalLM(LlamaForCausalLM):
    sparse_block = SparseMoeBlock  # what a sparse layer's MLP is (Qwen2-MoE adds a shared expert)

    def decoder_layer(
        self, cfg: TransformerConfig, index: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> nn.Module:
        """A sparse layer where `MoeConfig.is_sparse` says so, else the dense Llama layer (Qwen's mlp_only_layers
        and decoder_sparse_step)."""
        if cfg.moe is None or not cfg.moe.is_sparse(index):
            return LlamaDecoderLayer(cfg, rope, backend, index)
        return MoeDecoderLayer(cfg, rope, backend, index, self.sparse_block(cfg))

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := EXPERT.search(name):
            param, part = EXPERT_PARTS[m[2]]
            return f"{name[: m.start()]}.experts.{param}", (int(m[1]), part)
        if m := STACKED_EXPERTS.search(name):
            return f"{name[: m.start()]}.experts.{'w13_weight' if m[1] == 'gate_up_proj' else 'w2_weight'}", None
        return super().checkpoint_target(name)

    def _shard_ids(self, name: str) -> list[Any]:
        module = self.get_submodule(name.rpartition(".")[0])
        if isinstance(module, FusedMoE):
            return module.shard_ids(self.get_parameter(name))
        return super()._shard_ids(name)
