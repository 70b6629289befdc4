import pytest
import torch

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
