"""Qwen3: the Llama block with RMSNorm over each head of q and k before RoPE, no q/k/v bias
(set by TransformerConfig)."""

from heron.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
