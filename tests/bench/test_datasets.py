import random

import pytest

from heron.bench.datasets import parse_range, random_token_requests, shared_prefix_requests


def anchors_workload(num_seqs=256, max_input_len=1024, max_output_len=1024):
    """ANCHORS.md's offline workload, written as nano-vllm's bench.py draws it (global random, seed 0)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, outputs


def test_default_is_the_anchors_workload():
    reqs = random_token_requests()
    prompts, outputs = anchors_workload()
    assert [r.prompt_token_ids for r in reqs] == prompts
    assert [r.output_len for r in reqs] == outputs
    assert len(reqs) == 256
    assert sum(outputs) == 133_966  # the total ANCHORS.md quotes


def test_deterministic_and_independent_of_global_random():
    random.seed(123)
    a = random_token_requests(8, (5, 9), (3, 4), seed=7)
    state = random.getstate()
    b = random_token_requests(8, (5, 9), (3, 4), seed=7)
    assert a == b
    assert random.getstate() == state  # the global generator is left alone
    assert a != random_token_requests(8, (5, 9), (3, 4), seed=8)


def test_ranges_are_inclusive_and_respected():
    reqs = random_token_requests(200, (2, 4), (1, 3), seed=1, max_token_id=5)
    assert {len(r.prompt_token_ids) for r in reqs} == {2, 3, 4}
    assert {r.output_len for r in reqs} == {1, 2, 3}
    assert {t for r in reqs for t in r.prompt_token_ids} == set(range(6))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="input_len"):
        random_token_requests(1, (5, 4), (1, 1))
    with pytest.raises(ValueError, match="output_len"):
        random_token_requests(1, (1, 1), (0, 1))
    with pytest.raises(ValueError, match="num_prompts"):
        random_token_requests(0)


def test_parse_range():
    assert parse_range("100,1024") == (100, 1024)
    assert parse_range("128") == (128, 128)
    with pytest.raises(ValueError):
        parse_range("1,2,3")


def test_shared_prefix_workload():
    reqs = shared_prefix_requests(12, 3, 20, (2, 4), (5, 6), seed=1)
    assert reqs == shared_prefix_requests(12, 3, 20, (2, 4), (5, 6), seed=1)
    assert sorted(r.prefix_id for r in reqs) == [0] * 4 + [1] * 4 + [2] * 4
    for k in range(3):
        group = [r.prompt_token_ids for r in reqs if r.prefix_id == k]
        assert all(p[:20] == group[0][:20] and 22 <= len(p) <= 24 for p in group)
    assert len({tuple(r.prompt_token_ids[:20]) for r in reqs}) == 3
    assert {r.output_len for r in reqs} <= {5, 6} and all(r.prefix_len == 20 for r in reqs)
    assert [r.prefix_id for r in reqs] != sorted(r.prefix_id for r in reqs)  # interleaved
    with pytest.raises(ValueError, match="num_prefixes"):
        shared_prefix_requests(2, 3)
