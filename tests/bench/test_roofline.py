import dataclasses
import itertools

import pytest
import torch

from heron.attention.torch_ref import TorchAttentionBackend
from heron.bench.roofline import ModelCost, copy_bandwidth, matmul_rate, prefill_flops, workload_bound
from heron.models.config import TransformerConfig

CFG = TransformerConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
    qk_norm=False,
    eos_token_ids=(),
    bos_token_id=None,
)


class _Tiny(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(100, 16)
        self.layer = torch.nn.Linear(16, 16, bias=False)
        self.lm_head = torch.nn.Linear(16, 100, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_model_cost_counts_what_a_decode_step_reads():
    untied = ModelCost.of(_Tiny(False), CFG, torch.float32)
    assert untied.decode_weight_bytes == (16 * 16 + 100 * 16) * 4  # the input embedding is a row lookup
    tied = ModelCost.of(_Tiny(True), CFG, torch.float32)
    assert tied.decode_weight_bytes == (16 * 16 + 100 * 16) * 4  # the shared matrix once
    assert untied.kv_bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert untied.layer_params == 2 * (16 * (16 + 2 * 8) + 16 * 16 + 3 * 16 * 32)
    assert untied.lm_head_params == 1600 and untied.attn_flops_per_pair == 4 * 2 * 16


def test_workload_bound_matches_a_step_by_step_count():
    cost = ModelCost(
        layer_params=1000, lm_head_params=100, decode_weight_bytes=10_000, kv_bytes_per_token=10, attn_flops_per_pair=7
    )
    lengths = [(5, 3), (2, 6), (4, 1)]
    kv_reads = sum(p + j for p, o in lengths for j in range(1, o))  # fed-back token j attends to p + j keys
    pairs = sum(i for p, o in lengths for i in range(1, p + o))
    steps = max(6, -(-10 // 2))
    bound = workload_bound(cost, lengths, batch_size=2, bandwidth=1e3, flop_rate=1e6)
    assert bound.bytes_moved == steps * 10_000 + 10 * kv_reads
    assert bound.flops == 2 * 1000 * sum(p + o - 1 for p, o in lengths) + 2 * 100 * 10 + 7 * pairs
    assert bound.min_seconds == pytest.approx(max(bound.bytes_moved / 1e3, bound.flops / 1e6))
    assert bound.bound_by == "memory"


def test_machine_rates_are_positive():
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, reps=1) > 0
    assert matmul_rate(torch.device("cpu"), torch.float32, n=64, reps=1) > 0


def test_prefill_flops_count_the_lm_head_once_per_prompt():
    cost = ModelCost(
        layer_params=1000, lm_head_params=100, decode_weight_bytes=0, kv_bytes_per_token=0, attn_flops_per_pair=7
    )
    matmul, attention = prefill_flops(cost, [3, 5])
    assert matmul == 2 * 1000 * 8 + 2 * 100 * 2
    assert attention == 7 * (1 + 2 + 3 + 1 + 2 + 3 + 4 + 5)  # query i attends to keys 1..i


def _moe_cost(**experts) -> ModelCost:
    return ModelCost(
        layer_params=0,
        lm_head_params=0,
        decode_weight_bytes=1000,
        kv_bytes_per_token=0,
        attn_flops_per_pair=0,
        **experts,
    )


def test_a_moe_step_reads_the_experts_its_tokens_touch():
    from heron.models.config import MoeConfig
    from heron.models.registry import get_model_cls

    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=8, renormalize=False, shared_expert_intermediate_size=4)
    cfg = dataclasses.replace(
        CFG, architecture="Qwen2MoeForCausalLM", moe=dataclasses.replace(moe, mlp_only_layers=(1,))
    )
    with torch.device("meta"):
        model = get_model_cls(cfg.architecture)(cfg, TorchAttentionBackend(4, 2, 4, 1.0))
    cost = ModelCost.of(model, cfg, torch.float32)
    experts = 8 * 3 * 16 * 8 * 4  # layer 0's stacked experts, float32; layer 1 is dense
    assert cost.expert_bytes == experts and (cost.num_experts, cost.experts_per_token) == (8, 2)
    attention = 16 * (16 + 2 * 8) + 16 * 16
    sparse = 16 * 8 + 3 * 16 * 8 * 2 + 3 * 16 * 4 + 16  # router, 2 experts, the shared expert and its gate
    assert cost.layer_params == 2 * attention + sparse + 3 * 16 * 32
    assert cost.step_weight_bytes(1) == cost.decode_weight_bytes - experts * 6 / 8  # 2 of 8 experts read
    assert cost.step_weight_bytes(1000) == pytest.approx(cost.decode_weight_bytes)  # every expert, nearly surely
    assert ModelCost.of(_Tiny(False), CFG, torch.float32).step_weight_bytes(1) == (16 * 16 + 100 * 16) * 4


def _schedules(outputs: list[int], steps: int, batch: int):
    """Every way to give request i outputs[i] of `steps` steps, at most `batch` requests a step: tokens a step."""
    for picks in itertools.product(*(itertools.combinations(range(steps), o) for o in outputs)):
        tokens = [sum(s in p for p in picks) for s in range(steps)]
        if max(tokens) <= batch:
            yield tokens


@pytest.mark.parametrize("outputs, batch", [([3, 1, 2], 2), ([4, 4, 1, 2, 3], 3), ([2, 5, 1], 4), ([3, 3], 1)])
def test_moe_weight_bytes_are_the_least_any_schedule_reads(outputs, batch):
    cost = _moe_cost(expert_bytes=800, num_experts=8, experts_per_token=2)
    steps = max(max(outputs), -(-sum(outputs) // batch))
    least = min(sum(map(cost.step_weight_bytes, s)) for s in _schedules(outputs, steps, batch))  # (no step is empty)
    assert cost.weight_bytes_read(outputs, batch) == pytest.approx(least)
    assert _moe_cost().weight_bytes_read(outputs, batch) == steps * 1000  # dense: every step reads every weight


def test_workload_bound_reads_a_shared_prefix_once_a_step_per_group():
    cost = ModelCost(
        layer_params=1000, lm_head_params=100, decode_weight_bytes=10_000, kv_bytes_per_token=10, attn_flops_per_pair=7
    )
    lengths, s, group = [(5, 3), (6, 4), (4, 2)], 3, [0, 0, 1]  # groups {0, 1} and {2} open with 3 shared tokens
    plain = workload_bound(cost, lengths, batch_size=2, bandwidth=1e3, flop_rate=1e6)
    bound = workload_bound(cost, lengths, batch_size=2, bandwidth=1e3, flop_rate=1e6, shared=(s, group))
    # each group's prefix once a step for its longest output's fed-back tokens, instead of once a request
    saved_kv = s * (2 + 3 + 1) - s * (3 + 1)
    assert plain.bytes_moved - bound.bytes_moved == 10 * saved_kv
    tri = lambda n: n * (n + 1) // 2
    saved = 2 * 1000 * s * (3 - 2) + 7 * tri(s) * (3 - 2)  # the prefix computed once a group
    assert plain.flops - bound.flops == saved
