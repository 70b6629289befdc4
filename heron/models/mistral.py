"""Mistral 7B: the Llama block whose attention keeps to a sliding window (`sliding_window`, 4096 in v0.1; none
from v0.2 on): each token attends to the last W keys, its own included, so a prompt may run past the window up to
max_position_embeddings (set by TransformerConfig, honoured by every layer's attention)."""

from heron.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
