"""What llama.cpp's converter (convert_hf_to_gguf.py) writes differently for each architecture, so that
`gguf_loader` can give every family back its Hugging Face names, layouts and config.

Per family: the GGUF `general.architecture` and the Hugging Face class it came from, the block tensors whose
Hugging Face name differs from the common table, the metadata beyond the common keys, and what the converter did
to the weights:

* llama: q/k rows of each head interleaved for llama.cpp's RoPE (undone by `gguf_loader`).
* Gemma 2/3: every norm weight stored as 1 + w (Gemma's RMSNorm scales by 1 + w; llama.cpp's by w), and the
  query scale not stored at all: llama.cpp takes head_dim, except for the 27B models (hidden / heads), which it
  recognises by their layer count. Gemma 3's local layers use RoPE base 10,000 unless `rope.freq_base_swa` says
  otherwise, and one layer in six is global unless `attention.sliding_window_pattern` says otherwise.
* Phi-3: q/k/v and gate/up stay fused (`attn_qkv`, `ffn_up` of 2 x intermediate rows), as in the Hugging Face
  checkpoint; LongRoPE's factors are tensors (`rope_factors_long` / `_short`), not metadata.
* Qwen2-MoE / Qwen3-MoE: each projection of all experts in one tensor [E, rows, cols]; the router `ffn_gate_inp`;
  Qwen2-MoE's shared expert `*_shexp` and its gate. A block without a router is a dense one (`mlp_only_layers`).

Mistral files are written as `llama` (the same weights and math) and carry no sliding window: they load as
Llama, which is exact for Mistral v0.2+ and for prompts within v0.1's 4,096-token window. Mixtral files are
`llama` with expert tensors, which transformers does not read either; they are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Key = Callable[..., Any]  # key(name, default=None, required=False): the file's `{arch}.{name}` metadata


@dataclass(frozen=True)
class GGUFFamily:
    hf_architecture: str
    model_type: str
    tensors: dict[str, str] = field(default_factory=dict)  # block piece -> Hugging Face module, beyond the common
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # subtracted from every *norm.weight (Gemma: the converter stored 1 + w)
    permute_qk: bool = False  # llama only: q/k rows interleaved for llama.cpp's RoPE
    config: Callable[[str, Key, dict, Callable], dict] | None = None  # (arch, key, tensors, read) -> config extras


def _moe(norm_topk_prob: bool) -> Callable[[str, Key, dict, Callable], dict]:
    def config(arch: str, key: Key, tensors: dict, read: Callable) -> dict:
        layers = key("block_count", required=True)
        norm = key("expert_weights_norm")
        return {
            "num_experts": key("expert_count", required=True),
            "num_experts_per_tok": key("expert_used_count", required=True),
            "moe_intermediate_size": key("expert_feed_forward_length", required=True),
            "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": norm_topk_prob if norm is None else bool(norm),
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        }

    return config


def _gemma_query_scalar(arch: str, key: Key, head_dim: int) -> int:
    big = {"gemma2": 46, "gemma3": 62}[arch]  # the 27B models' layer counts
    hidden, heads = key("embedding_length", required=True), key("attention.head_count", required=True)
    return hidden // heads if key("block_count") == big else head_dim


def _gemma2(arch: str, key: Key, tensors: dict, read: Callable) -> dict:
    head_dim = key("attention.key_length", required=True)
    return {
        "sliding_window": key("attention.sliding_window"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "query_pre_attn_scalar": _gemma_query_scalar(arch, key, head_dim),
    }


def _gemma3(arch: str, key: Key, tensors: dict, read: Callable) -> dict:
    head_dim = key("attention.key_length", required=True)
    layers = key("block_count", required=True)
    pattern = key("attention.sliding_window_pattern", 6, per_layer=True)
    if isinstance(pattern, list):  # llama.cpp's per-layer flags: true = a sliding-window layer
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    return {
        "sliding_window": key("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": float(key("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": _gemma_query_scalar(arch, key, head_dim),
        "final_logit_softcapping": key("final_logit_softcapping"),
    }


def _phi3(arch: str, key: Key, tensors: dict, read: Callable) -> dict:
    heads = key("attention.head_count", required=True)
    head_dim = key("embedding_length", required=True) // heads
    out: dict = {"sliding_window": key("attention.sliding_window")}
    if (rotary := key("rope.dimension_count")) and rotary != head_dim:
        out["partial_rotary_factor"] = rotary / head_dim
    if "rope_factors_long.weight" in tensors:
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": read("rope_factors_long.weight").astype(np.float64).tolist(),
            "short_factor": read("rope_factors_short.weight").astype(np.float64).tolist(),
        }
        out["original_max_position_embeddings"] = key("rope.scaling.original_context_length", required=True)
        if (attn := key("rope.scaling.attn_factor")) is not None:
            out["rope_scaling"]["attention_factor"] = attn
    return out


_GEMMA_TENSORS = {"ffn_norm": "pre_feedforward_layernorm"}

FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": GGUFFamily("Qwen2MoeForCausalLM", "qwen2_moe", config=_moe(norm_topk_prob=False)),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", "qwen3_moe", config=_moe(norm_topk_prob=True)),
    "phi3": GGUFFamily("Phi3ForCausalLM", "phi3", tensors={"ffn_up": "mlp.gate_up_proj"}, config=_phi3),
    "gemma2": GGUFFamily(
        "Gemma2ForCausalLM", "gemma2", _GEMMA_TENSORS, "gelu_pytorch_tanh", norm_offset=1.0, config=_gemma2
    ),
    "gemma3": GGUFFamily(
        "Gemma3ForCausalLM", "gemma3_text", _GEMMA_TENSORS, "gelu_pytorch_tanh", norm_offset=1.0, config=_gemma3
    ),
}
