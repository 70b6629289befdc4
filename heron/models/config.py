"""The shape of a decoder-only transformer, read once from a Hugging Face `config.json` dict. What the shared
blocks cannot compute is refused here, by name, before any weight is read."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from heron.attention import AttentionParams

logger = logging.getLogger(__name__)

# config.json's model_type -> architecture, for a config without `architectures`
_BY_MODEL_TYPE = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Architectures whose attention keeps to each layer's sliding window (LlamaAttention passes it to the backend).
# Any other with a window shorter than its context is capped at the window, where full attention agrees with it.
SLIDING_WINDOW_ARCHITECTURES = {
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
}

# config.json's hidden_act (Gemma: hidden_activation) -> the gated MLP it names
GATED_ACTIVATIONS = {"silu": "SwiGLU", "gelu_pytorch_tanh": "GeGLU, tanh-approximated GELU"}


@dataclass(frozen=True)
class MoeConfig:
    """The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE: each token's router picks `top_k`
    of `num_experts` SwiGLU experts (softmax, then top-k; the k weights rescaled to sum to one if `renormalize`)
    and sums their outputs with those weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # Mixtral always; Qwen per norm_topk_prob
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, gated by a sigmoid
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP (of TransformerConfig.intermediate_size)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 (and not in mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], arch: str) -> MoeConfig | None:
        """None for a dense model. transformers writes Qwen3-MoE's expert count as `num_local_experts`, the
        Qwen checkpoints as `num_experts`."""
        num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        if not num_experts:
            return None
        mixtral = arch.startswith("Mixtral")
        return cls(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
            renormalize=mixtral or bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
        )


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # {"rope_type": "linear" | "llama3" | "longrope", ...}; None for plain RoPE. Gemma 3: its global layers' RoPE
    rope_scaling: dict | None
    max_position_embeddings: int  # the longest sequence: config.json's, or a window that caps it (see from_hf)
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model
    # Attention per layer, the MLP's activation, the logits (Mistral, Phi-3, Gemma 2 / 3); defaults: Llama's
    hidden_act: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    sliding_window: int | None = None  # keys a sliding layer sees, its query's own included
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer; () where all are full
    query_scale: float | None = None  # on q . k; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # attention scores s -> c * tanh(s / c) (Gemma 2)
    final_logit_softcap: float | None = None  # logits likewise (Gemma 2)
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base, without scaling (Gemma 3)

    def heads_per_rank(self, tp_size: int) -> tuple[int, int]:
        """(query heads, KV heads) of one tensor-parallel rank. The KV cache is split by KV heads, never
        replicated, so both counts must divide by `tp_size`."""
        for name, heads in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)):
            if heads % tp_size:
                raise ValueError(
                    f"{name}={heads} is not divisible by tensor_parallel_size={tp_size}: each rank "
                    "must hold whole attention heads (the KV cache is split by KV heads)."
                )
        return self.num_heads // tp_size, self.num_kv_heads // tp_size

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def attention_params(self, layer: int) -> AttentionParams:
        """What layer `layer`'s attention computes beyond full causal attention, for the backend."""
        return AttentionParams(
            scale=self.query_scale or self.head_dim**-0.5,
            sliding_window=self.sliding_window if self.is_sliding(layer) else None,
            logits_soft_cap=self.attn_logit_softcap,
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TransformerConfig:
        arch = (
            hf.get("architectures") or [_BY_MODEL_TYPE.get(hf.get("model_type"), f"model_type={hf.get('model_type')}")]
        )[0]
        if arch == "Gemma3ForConditionalGeneration":
            hf = _gemma3_language_model(hf)
        act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported (the MLP is gated: "
                + ", ".join(f"{a} ({m})" for a, m in GATED_ACTIVATIONS.items())
                + ")."
            )
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model's) is not supported: Heron decodes.")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        max_positions = hf.get("max_position_embeddings", 4096)
        # transformers 5 gathers RoPE settings in `rope_parameters` (Gemma 3: one set per layer type); earlier
        # versions use `rope_theta` and `rope_scaling` (Gemma 3: `rope_local_base_freq` for the sliding layers).
        params = hf.get("rope_parameters") or {}
        per_type = "full_attention" in params
        rope = dict((params["full_attention"] if per_type else params) or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
        if rope_type not in ("default", "linear", "llama3", "longrope"):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, longrope / su)."
            )
        if (partial := rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported.")
        if rope_type == "longrope":
            rope = _longrope(rope, hf, max_positions, head_dim)
        local_theta = _local_rope_theta(params if per_type else None, hf)
        window, layer_types = _sliding_layers(arch, hf, hf["num_hidden_layers"])
        if window is not None and window >= max_positions:
            window, layer_types = None, ()  # a window past the context changes nothing
        if window is not None and arch not in SLIDING_WINDOW_ARCHITECTURES:
            # this model's attention spans the whole sequence: the same as the window up to its length
            logger.warning(
                "%s has sliding-window attention (sliding_window=%d) and Heron's %s does not: its context is "
                "capped at %d tokens (max_position_embeddings %d), where both attend alike.",
                arch,
                window,
                arch,
                window,
                max_positions,
            )
            max_positions, window, layer_types = window, None, ()
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scalar = hf.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", hf.get("qkv_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith(("Qwen3", "Gemma3")),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            hidden_act=act,
            sliding_window=window,
            layer_types=layer_types,
            query_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            local_rope_theta=local_theta,
            moe=MoeConfig.from_hf(hf, arch),
        )


def _sliding_layers(arch: str, hf: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(the window, each layer's type) as transformers derives them where config.json has no `layer_types`:
    Gemma 2 alternates (sliding first), Gemma 3 has one global layer in `sliding_window_pattern` (6), Qwen2 /
    Qwen3 slide from layer `max_window_layers` on, others slide in every layer."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if not window:
        return None, ()
    types = hf.get("layer_types")
    if types is None:
        if arch.startswith("Gemma2"):
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif arch.startswith("Gemma3"):
            pattern = hf.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            first = hf.get("max_window_layers", 28) if arch.startswith("Qwen") else 0  # (transformers' default)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} is not one of 'sliding_attention' / 'full_attention' per layer.")
    return (int(window), tuple(types)) if "sliding_attention" in types else (None, ())


def _longrope(rope: dict, hf: dict[str, Any], max_positions: int, head_dim: int) -> dict:
    """LongRoPE (Phi-3 128k, Phi-3.5): per-frequency divisors for short and long contexts, and the factor its
    cos / sin are scaled by (transformers' default: sqrt(1 + ln(s) / ln(original)), s = max / original)."""
    original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_type 'longrope' needs original_max_position_embeddings.")
    short, long = rope.get("short_factor"), rope.get("long_factor")
    if not (isinstance(short, list) and isinstance(long, list) and len(short) == len(long) == head_dim // 2):
        raise ValueError(f"rope_type 'longrope' needs short_factor and long_factor of head_dim / 2 ({head_dim // 2}).")
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    )
    return dict(
        short_factor=tuple(short),
        long_factor=tuple(long),
        original_max_position_embeddings=int(original),
        attention_factor=float(attention_factor),
    )


def _local_rope_theta(per_type: dict | None, hf: dict[str, Any]) -> float | None:
    """Gemma 3's sliding layers' RoPE base (plain RoPE: their scaling, if any, is refused)."""
    if per_type is None:
        base = hf.get("rope_local_base_freq")
        return None if base is None else float(base)
    local = per_type.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling on the sliding layers ({local}) is not supported.")
    return float(local.get("rope_theta", 10000.0))


def _gemma3_language_model(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json's `text_config`, with transformers' defaults for what it
    leaves out (hub configs give only what differs), as one config of its own: Heron runs the text model."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**hf.get("text_config", {})).to_dict()
    top = {k: hf[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in hf}
    return {**text, **top, "architectures": ["Gemma3ForConditionalGeneration"]}
