"""Phi-3 (mini and medium, 4k context): the Llama block. Its checkpoints store q/k/v and gate/up already fused
(`qkv_proj`, `gate_up_proj`), which `ColumnParallelLinear.weight_loader` takes whole, so only the name differs.

What the block cannot compute is refused by `TransformerConfig.from_hf`: LongRoPE (rope type 'longrope' or 'su',
the 128k models and Phi-3.5) and partial rotary embeddings (Phi-4-mini). The 4k models' 2047-token sliding
window caps their context there. Phi-3-mini's head_dim of 96 runs on the CPU only (the CUDA kernels take powers
of two); Phi-3-medium's is 128.
"""

from heron.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
