"""Qwen3-MoE (Qwen3 technical report, 2025): Qwen3's attention (RMSNorm over each head of q and k, no q/k/v bias)
with Mixtral's sparse MLP: 128 experts, 8 per token, no shared expert. The top-k weights are renormalised where
the config's `norm_topk_prob` says (it does in the released models), and layers listed in `mlp_only_layers` or
off the `decoder_sparse_step` keep a dense MLP; both are read into `MoeConfig`."""

from heron.models.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    pass
