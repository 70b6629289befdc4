"""Llama (2, 3, 3.1, SmolLM2): pre-norm decoder blocks of grouped-query attention with RoPE and a SwiGLU MLP.
Mistral (a sliding window), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Phi-3 differ only in switches
of `TransformerConfig` or in their checkpoints' layout, and reuse this file; Gemma 2 / 3 reuse its attention and
MLP. Each layer's attention knows its own `AttentionParams` (a sliding window, ...) and hands them to the backend.

The kernels are the layers' business (heron/layers): each pre-norm RMSNorm is built with the projection it feeds
(`NormLinear`: at decode sizes on a GPU one kernel does the residual add, the norm and the projection), the down
projection takes SwiGLU's activation in, and the rotary embedding writes this step's K and V into the paged cache.
q/k/v and gate/up are each one fused projection; `load_weights` stacks a checkpoint's separate matrices into them.
Under tensor parallelism each rank builds the same modules with its share of the heads, of the MLP columns and of
the vocabulary, and loads its slices of the full checkpoint tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from heron.attention import AttentionBackend, AttentionMetadata
from heron.distributed import get_tp_world_size
from heron.layers.layernorm import NormLinear, RMSNorm
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear, default_weight_loader
from heron.layers.rotary import RotaryEmbedding
from heron.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from heron.models.config import TransformerConfig

# A checkpoint's KV-cache scales (compressed-tensors' and vLLM's names; AutoFP8's older kv_scale / output_scale)
KV_SCALE_NAMES = (".k_scale", ".v_scale", ".kv_scale", "k_proj.output_scale", "v_proj.output_scale")


class LlamaAttention(nn.Module):
    norm_offset = 0.0  # the q/k norms' weight offset (Gemma 3: 1, its norms scale by 1 + w)

    def __init__(self, cfg: TransformerConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.heads_per_rank(get_tp_world_size())  # this rank's heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_full, kv_full, kv_full], bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, self.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, self.norm_offset) if cfg.qk_norm else None
        self.rotary_emb = rope
        self.backend = backend
        self.attn_params = cfg.attention_params(layer)
        self.kv_cache: torch.Tensor | None = None  # this layer's [2, blocks, block_size, Hkv, D], bound by the runner

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv: qkv_proj's output (run by the decoder layer's input norm, which is built with it)."""
        return self.o_proj(self.attend(positions, qkv, meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention's output before o_proj [T, heads * head_dim] (a MoE layer runs o_proj with the norm and
        the router after it)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # (q/k norm,) rotary: one kernel on a GPU, which also writes this step's k and v into the paged cache
        p = self.attn_params
        q = self.rotary_emb.rotate_and_cache(
            positions, q, k, v, self.kv_cache, meta.slot_mapping, self.q_norm, self.k_norm, (p.k_scale, p.v_scale)
        )
        return self.backend.forward(q, self.kv_cache, meta, self.attn_params).flatten(1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False)
        act = cfg.hidden_act  # silu: SwiGLU; gelu_pytorch_tanh: GeGLU (TransformerConfig refuses others)
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, swiglu=act == "silu", geglu=act == "gelu_pytorch_tanh"
        )

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: gate_up_proj's output (run by the post-attention norm); down_proj(act(gate) * up)."""
        return self.down_proj(gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        attn, mlp = LlamaAttention(cfg, rope, backend, layer), LlamaMLP(cfg)
        # each norm runs with the projection it feeds: one kernel at decode sizes
        self.input_layernorm = NormLinear(cfg.hidden_size, cfg.rms_norm_eps, attn.qkv_proj)
        self.self_attn = attn
        self.post_attention_layernorm = NormLinear(cfg.hidden_size, cfg.rms_norm_eps, mlp.gate_up_proj)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, qkv, meta)
        gate_up, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(gate_up), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (fused parameter name piece, shard index)
    stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    norm_offset = 0.0  # the final norm's weight offset (Gemma: 1, its norms scale by 1 + w)

    def __init__(self, cfg: TransformerConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = self.build_layers(cfg, backend)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.materialize()

    def build_layers(self, cfg: TransformerConfig, backend: AttentionBackend) -> nn.ModuleList:
        """The decoder layers, sharing one RoPE table."""
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return nn.ModuleList(self.decoder_layer(cfg, i, rope, backend) for i in range(cfg.num_layers))

    def decoder_layer(
        self, cfg: TransformerConfig, index: int, rope: RotaryEmbedding, backend: AttentionBackend
    ) -> nn.Module:
        """Layer `index` of the stack (a family whose layers differ overrides this)."""
        return LlamaDecoderLayer(cfg, rope, backend, index)

    def materialize(self) -> None:
        """Tie the LM head to the embedding (again: moving off the `meta` device unties them)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of T tokens -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, vocab] of the final hidden states (into `out` if given), soft-capped as c * tanh(l / c)
        where the config says so (Gemma 2)."""
        logits = self.lm_head.float_logits(hidden, out)
        if cap := self.cfg.final_logit_softcap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand each checkpoint tensor (Hugging Face name, full shape) to its parameter's loader, which copies this
        rank's slice (into its part of a fused parameter, or into every part for a tensor stored fused); every
        parameter (every part of a fused one) must be covered."""
        params = dict(self.named_parameters())
        expected = {(n, s) for n in params for s in self._shard_ids(n)}
        if self.cfg.tie_word_embeddings:
            expected.discard(("lm_head.weight", None))
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.endswith(KV_SCALE_NAMES):
                self.load_kv_scale(name, tensor)
                continue
            target, shard = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            module = self.get_submodule(target.rpartition(".")[0])
            loader = getattr(module, "weight_loader", default_weight_loader)
            try:
                loader(params[target], tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from None
            loaded.update([(target, shard)] if shard is not None else ((target, s) for s in self._shard_ids(target)))
        if missing := expected - loaded:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(n for n, _ in missing)[:5]}")

    def load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint's calibrated KV-cache scale (`layers.{i}.self_attn.k_scale`, ...) into its layer's
        AttentionParams, which a float8 cache divides by on the write and multiplies by on the read (a cache in
        the model's dtype ignores it, as vLLM does). Per tensor only: one scale a layer for K, one for V."""
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer is None or tensor.numel() != 1:
            raise ValueError(
                f"checkpoint tensor {name!r} {tuple(tensor.shape)}: only per-tensor KV-cache scales of a decoder "
                "layer are supported."
            )
        attn = self.layers[int(layer.group(1))].self_attn
        value = float(tensor)
        if not value > 0:
            raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale of {value}; it must be positive.")
        keys = ("k_scale", "v_scale") if name.endswith(".kv_scale") else ("v_scale" if ".v_" in name else "k_scale",)
        attn.attn_params = dataclasses.replace(attn.attn_params, **dict.fromkeys(keys, value))

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """A checkpoint tensor's (parameter name, shard id): a separate matrix goes into its part of a fused
        parameter (`stacked`), anything else whole (None)."""
        piece = next((p for p in self.stacked if f".{p}." in name), None)
        if piece is None:
            return name, None
        return name.replace(piece, self.stacked[piece][0]), self.stacked[piece][1]

    def _shard_ids(self, name: str) -> list[Any]:
        """The parts a checkpoint fills a parameter from: one per fused matrix, else the whole."""
        module = self.get_submodule(name.rpartition(".")[0])
        if isinstance(module, ColumnParallelLinear) and len(module.output_sizes) > 1:
            return list(range(len(module.output_sizes)))
        return [None]
