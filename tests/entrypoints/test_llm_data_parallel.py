"""`LLM(data_parallel_size=2)` and `heron run-batch --data-parallel-size 2`: two local replicas of the embedded
model share the prompts, and the outputs are one engine's (greedy), in input order."""

from __future__ import annotations

import argparse
import json

import pytest

from heron import LLM, SamplingParams
from heron.entrypoints.engine_args import engine_config
from heron.entrypoints.openai import run_batch_cli
from heron.entrypoints.openai.run_batch import run_batch

PROMPTS = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM(data_parallel_size=2, max_model_len=1024, kv_cache_memory=128 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def one_engine(embedded_llm):
    return {o.prompt: o.outputs[0] for o in embedded_llm.generate(PROMPTS, GREEDY, use_tqdm=False)}


def test_outputs_are_one_engines_in_input_order_over_both_replicas(dp_llm, one_engine):
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in got] == PROMPTS
    for o in got:
        assert (o.outputs[0].token_ids, o.outputs[0].text) == (
            one_engine[o.prompt].token_ids,
            one_engine[o.prompt].text,
        )
    assert all(stats.prompt_tokens > 0 for stats, _ in dp_llm.engine._client.replica_stats())


def test_run_batch_over_replicas(dp_llm, one_engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"max_tokens": 6, "temperature": 0}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": p}}
        for i, p in enumerate(PROMPTS)
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(dst, "w", encoding="utf-8") as out:
        # run-batch's engine with -dp 2 is the replicas' front (DataParallelAsyncLLM), as under the offline LLM
        summary = run_batch(dp_llm.engine._client, str(src), out, set(), progress=False)
    assert (summary.written, summary.errors) == (len(PROMPTS), 0)
    results = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, dst.read_text().splitlines())}
    for i, p in enumerate(PROMPTS):
        assert results[f"r{i}"]["choices"][0]["text"] == one_engine[p].text


def test_run_batch_flag():
    parser = argparse.ArgumentParser()
    run_batch_cli.register(parser.add_subparsers())
    args = parser.parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "-dp", "2"])
    parallel = engine_config(args).parallel
    assert (parallel.data_parallel_size, parallel.data_parallel_backend) == (2, "mp")
