"""The shape of a decoder-only transformer, read once from a Hugging Face `config.json` dict. What the shared
blocks cannot compute is refused here, by name, before any weight is read."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# config.json's model_type -> architecture, for a config without `architectures`
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


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
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3", ...}; None for plain RoPE
    max_position_embeddings: int  # the longest sequence: config.json's, or its sliding window where shorter
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model

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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TransformerConfig:
        arch = (
            hf.get("architectures") or [_BY_MODEL_TYPE.get(hf.get("model_type"), f"model_type={hf.get('model_type')}")]
        )[0]
        if (act := hf.get("hidden_act", "silu")) != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu).")
        heads = hf["num_attention_heads"]
        # transformers 5 gathers RoPE settings in `rope_parameters`; earlier versions use
        # `rope_theta` and `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3).")
        if (partial := rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported.")
        max_positions = hf.get("max_position_embeddings", 4096)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window and window < max_positions:
            # Heron attends over the whole sequence: the same as a window of `window` tokens up to that length.
            logger.warning(
                "%s has sliding-window attention (sliding_window=%d) and Heron does not: its context is capped "
                "at %d tokens (max_position_embeddings %d), where both attend alike.",
                arch,
                window,
                window,
                max_positions,
            )
            max_positions = window
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", hf.get("qkv_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3"),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            moe=MoeConfig.from_hf(hf, arch),
        )
