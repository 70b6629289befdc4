"""Architecture name (config.json's `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from heron.models.gemma2 import Gemma2ForCausalLM
from heron.models.gemma3 import Gemma3ForCausalLM
from heron.models.llama import LlamaForCausalLM
from heron.models.mistral import MistralForCausalLM
from heron.models.mixtral import MixtralForCausalLM
from heron.models.phi3 import Phi3ForCausalLM
from heron.models.qwen2 import Qwen2ForCausalLM
from heron.models.qwen2_moe import Qwen2MoeForCausalLM
from heron.models.qwen3 import Qwen3ForCausalLM
from heron.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model (gemma3.py)
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_cls(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}. (A model whose "
            "code ships in its folder, `auto_map` in config.json, cannot run either: --trust-remote-code is "
            "accepted, but Heron runs only its own model code.)"
        )
    return MODELS[architecture]
