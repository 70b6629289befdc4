"""The host's cost of admitting a request with a long shared prompt, on the CPU: issue 26's prefix workload
(512 requests, 16 system prompts of 2,000 tokens x 32, each + a 50-200 token question) through what a step
does per new request before the GPU sees it: the prompt's id check (LLMEngine.add_request's) and the prefix
cache's lookup (BlockManager.find_cached: the block hashes, then the cached blocks). Twice: with the block
manager's hash memo (the engine's path: a system prompt's blocks hashed once), and with the memo cleared
before every request (each prompt hashed from scratch). A step that admits k such requests spends k times this
on the host; the profile of `gpu_check.sh profile-prefix` shows prefill steps waiting on it.

    PYTHONPATH=. python benchmarks/admission_host.py [--save-result]   (records cpu-admission-host.json)
"""

from __future__ import annotations

import argparse
import time

from heron.bench.datasets import shared_prefix_requests
from heron.bench.report import finish
from heron.engine import block_manager
from heron.engine.block_manager import BlockManager
from heron.engine.request import Request
from heron.sampling_params import SamplingParams

VOCAB = 151936  # Qwen3's


def admit_all(prompts: list[list[int]], memo: bool) -> float:
    """Seconds per request to check and look up every prompt in a fresh block manager."""
    bm = BlockManager(num_blocks=4096, block_size=16)
    seqs = [Request(f"r{i}", None, p, SamplingParams()).seqs[0] for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for seq in seqs:
        ids = seq.token_ids
        if min(ids) < 0 or max(ids) >= VOCAB:
            raise ValueError("out of the vocabulary")
        if not memo:
            bm.hash_memo.clear()
        bm.find_cached(seq)
    return (time.perf_counter() - start) / len(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save-result", action="store_true")
    args = parser.parse_args()
    prompts = [r.prompt_token_ids for r in shared_prefix_requests()]
    assert block_manager.HASH_MEMO_ENTRIES >= 16 * 2000 // 16 + 200  # the 16 prompts' blocks fit in the memo
    best = {m: min(admit_all(prompts, m) for _ in range(args.repeats)) for m in (True, False)}
    tokens = sum(map(len, prompts)) / len(prompts)
    metrics = {
        "us_per_request_with_memo": best[True] * 1e6,
        "us_per_request_without_memo": best[False] * 1e6,
        "mean_prompt_tokens": tokens,
        "num_requests": len(prompts),
    }
    table = (
        f"admitting one of {len(prompts)} prefix-workload requests ({tokens:.0f} prompt tokens), best of "
        f"{args.repeats}: {best[True] * 1e6:.0f} us with the hash memo, {best[False] * 1e6:.0f} us without"
    )
    finish("cpu-admission-host", metrics, "cpu", table, args.save_result)


if __name__ == "__main__":
    main()
