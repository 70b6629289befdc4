"""Qwen2 / Qwen2.5: the Llama block with a bias on the q/k/v projections (set by TransformerConfig)."""

from heron.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
