"""Benchmark workloads: the requests a benchmark sends, independent of who serves them (Heron offline, Hugging
Face `generate`, or the HTTP server through the serving client).

`random_token_requests()` with its defaults is the offline workload of ../shared/ANCHORS.md (and of
nano-vllm's bench.py): 256 requests, `random.seed(0)`, for each prompt in turn a length
`randint(100, 1024)` then its ids `randint(0, 10000)`, then each output length `randint(100, 1024)`;
133,966 output tokens in all. Both ends of every range are inclusive, as in `random.randint`.

`shared_prefix_requests()` is the "prefix" workload (a chatbot's long system prompts, issue 26): K system prompts
of a fixed length, each opening num_prompts / K requests, each followed by a question of its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # exact: the request runs with ignore_eos and max_tokens = output_len
    prefix_len: int = 0  # the first prefix_len prompt tokens are a prompt shared with other requests
    prefix_id: int = -1  # which shared prompt (-1: none)


def random_token_requests(
    num_prompts: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    seed: int = 0,
    max_token_id: int = 10000,
) -> list[BenchRequest]:
    """Random token-id prompts with fixed output lengths. The draw order is part of the definition
    (it reproduces the anchors' figures): every prompt (length, then ids), then every output length."""
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {lo},{hi}.")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}.")
    if max_token_id < 0:
        raise ValueError(f"max_token_id must be non-negative, got {max_token_id}.")
    rng = random.Random(seed)  # the same stream as random.seed(seed), without touching the global one
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    return [BenchRequest(p, rng.randint(*output_len)) for p in prompts]


def shared_prefix_requests(
    num_prompts: int = 512,
    num_prefixes: int = 16,
    prefix_len: int = 2000,
    question_len: tuple[int, int] = (50, 200),
    output_len: tuple[int, int] = (64, 256),
    seed: int = 0,
    max_token_id: int = 10000,
) -> list[BenchRequest]:
    """num_prompts requests in a random order, num_prompts / num_prefixes of them (the first ones one more
    where it does not divide) opening with each of `num_prefixes` random system prompts of `prefix_len` tokens,
    then a random question of a length drawn from `question_len`; output lengths from `output_len`. Draw order:
    the system prompts, then per request its question (length, ids) and its output length, then the order."""
    if num_prefixes < 1 or prefix_len < 1 or num_prompts < num_prefixes:
        raise ValueError(
            f"need 1 <= num_prefixes <= num_prompts and prefix_len >= 1, "
            f"got {num_prefixes}, {num_prompts}, {prefix_len}."
        )
    for name, (lo, hi) in (("question_len", question_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {lo},{hi}.")
    rng = random.Random(seed)
    systems = [[rng.randint(0, max_token_id) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        question = [rng.randint(0, max_token_id) for _ in range(rng.randint(*question_len))]
        k = i % num_prefixes
        requests.append(BenchRequest(systems[k] + question, rng.randint(*output_len), prefix_len, k))
    rng.shuffle(requests)
    return requests


def parse_range(text: str) -> tuple[int, int]:
    """'100,1024' -> (100, 1024); a single number is a fixed length."""
    parts = [int(x) for x in text.replace(":", ",").split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ValueError(f"a length range is 'low,high' or one number, got {text!r}.")
    return parts[0], parts[1]
