"""Phi-3 / Phi-3.5 (mini, medium; 4k and 128k contexts): the Llama block. Its checkpoints store q/k/v and gate/up
already fused (`qkv_proj`, `gate_up_proj`), which `ColumnParallelLinear.weight_loader` takes whole, so only the
name differs.

The 4k models attend within a 2047-token sliding window (honoured by the attention, up to their 4096 positions).
The 128k models and Phi-3.5 use LongRoPE (rope type 'longrope' or 'su'): each RoPE frequency divided by its own
factor, a short set and a long set, cos / sin scaled by sqrt(1 + ln(s) / ln(4096)). Heron rotates with the long
set where the served context (max_model_len) passes the original 4096 positions, else the short one (see
heron/layers/rotary.py). Partial rotary embeddings (Phi-4-mini) are refused by `TransformerConfig.from_hf`.
Phi-3-mini's head_dim of 96 runs on the CPU only (the CUDA kernels take powers of two); Phi-3-medium's is 128.
"""

from heron.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
