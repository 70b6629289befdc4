"""Gemma 3, its language model (Gemma Team, "Gemma 3 Technical Report", 2025).

Gemma 2's block (gemma2.py: scaled embedding, (1 + w) norms, pre- and post-norms, GeGLU, tanh-approximated)
with these changes from the report:
- five local layers to each global one (`sliding_window_pattern` 6, or `layer_types`), local windows of 1024
  tokens (512 in 1B);
- RMSNorm over each head of q and k before RoPE (QK-norm) instead of soft-capping the scores;
- RoPE base 10k on local layers, 1M on global ones, which alone are rescaled for long context (linear, factor 8
  in 4B and up): two RoPE tables, one per kind of layer.
A `Gemma3ForConditionalGeneration` checkpoint (the multimodal 4B-27B) loads its text part: its language model's
tensors by their names, the vision tower and projector left out; images are not supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from heron.attention import AttentionBackend
from heron.layers.rotary import RotaryEmbedding
from heron.models.config import TransformerConfig
from heron.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from heron.models.llama import LlamaAttention

# A Gemma3ForConditionalGeneration checkpoint's names -> the text model's (transformers >= 4.52 writes the first)
LANGUAGE_MODEL = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}
NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3Attention(LlamaAttention):
    norm_offset = 1.0  # q_norm / k_norm are Gemma norms too


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def build_layers(self, cfg: TransformerConfig, backend: AttentionBackend) -> nn.ModuleList:
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta or 10000.0, None)
        return nn.ModuleList(
            Gemma3DecoderLayer(cfg, local if cfg.is_sliding(i) else rope, backend, i) for i in range(cfg.num_layers)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(language_model(weights))


def language_model(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under its own names (a text-only checkpoint's pass through unchanged)."""
    for name, tensor in weights:
        if name.startswith(NOT_TEXT):
            continue
        prefix = next((p for p in LANGUAGE_MODEL if name.startswith(p)), None)
        yield (name if prefix is None else LANGUAGE_MODEL[prefix] + name.removeprefix(prefix)), tensor
