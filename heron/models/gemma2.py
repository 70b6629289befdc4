"""Gemma 2 (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024).

The decoder block of Llama with these differences, each in the paper's architecture section:
- the embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype, as the reference code does);
- RMSNorm scales by (1 + w): the checkpoint's w is loaded as 1 + w (`weight_offset`);
- each sub-block is normed on its way in and on its way out: input_layernorm -> attention ->
  post_attention_layernorm, then pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm, each output
  added to the residual stream after its post-norm;
- the MLP is GeGLU, GELU's tanh approximation (`hidden_activation: gelu_pytorch_tanh`): its own kernel before
  the down projection, never the SwiGLU prologue of the GEMV;
- local and global attention alternate, local first: local layers see a sliding window of 4096 tokens;
- attention scores are scaled by query_pre_attn_scalar ** -0.5 and soft-capped, s -> 50 tanh(s / 50), and so
  are the final logits at 30 (`attn_logit_softcapping`, `final_logit_softcapping`);
- head_dim (256) is not hidden_size / heads in every size (9B: 3584 / 16).
Window, cap and scale reach the attention backend as each layer's `AttentionParams` (TransformerConfig).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from heron.attention import AttentionBackend, AttentionMetadata
from heron.layers.layernorm import NormLinear, RMSNorm
from heron.layers.rotary import RotaryEmbedding
from heron.models.config import TransformerConfig
from heron.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma2DecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: TransformerConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        attn, mlp = self.attention_cls(cfg, rope, backend, layer), LlamaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = NormLinear(h, eps, attn.qkv_proj, weight_offset=1.0)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(h, eps, weight_offset=1.0)
        self.pre_feedforward_layernorm = NormLinear(h, eps, mlp.gate_up_proj, weight_offset=1.0)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(h, eps, weight_offset=1.0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x', residual'): the residual stream is x + residual, as in the Llama block."""
        qkv, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, qkv, meta))
        gate_up, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(gate_up)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    norm_offset = 1.0

    def build_layers(self, cfg: TransformerConfig, backend: AttentionBackend) -> nn.ModuleList:
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return nn.ModuleList(Gemma2DecoderLayer(cfg, rope, backend, i) for i in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x, residual = x * normalizer(self.cfg.hidden_size, x.dtype), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


@functools.cache
def normalizer(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to the embedding's dtype, the factor transformers' Gemma multiplies by."""
    return torch.tensor(hidden_size**0.5, dtype=dtype).item()
