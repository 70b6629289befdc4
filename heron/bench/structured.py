"""Structured outputs under load (`heron bench throughput --structured-output json-schema`): every request of the
workload under one JSON schema (a nested object with enums, arrays and numbers), against the same requests
unconstrained, in the same run.

A grammar ends a request when its object closes, which with random (dummy) weights comes at any length up to
max_tokens. So the constrained arm runs first (ignore_eos; max_tokens the workload's output length), and the
unconstrained arm then asks each request for exactly the tokens its constrained run generated (ignore_eos):
both arms generate the same tokens per request, in the same batch shapes, and `ratio_vs_unconstrained` is
the ratio of their output tokens/s. The prefix cache is reset before each arm: both compute every prompt.
The schema's compile time is recorded cold (a new compiler) and cached."""

from __future__ import annotations

import time

from heron.bench.datasets import BenchRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "other"]}, "maxItems": 8},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "number"},
                "lon": {"type": "number"},
                "kind": {"enum": ["home", "work", "travel"]},
            },
            "required": ["lat", "lon", "kind"],
            "additionalProperties": False,
        },
        "readings": {"type": "array", "items": {"type": "number"}, "maxItems": 16},
    },
    "required": ["id", "status", "score", "tags", "location", "readings"],
    "additionalProperties": False,
}


def compile_times(llm) -> tuple[float, float]:
    """Seconds to compile SCHEMA for the model's tokenizer: cold (a new compiler, empty cache), then cached."""
    from heron.engine.structured_output import StructuredOutputManager
    from heron.sampling_params import StructuredOutputsParams

    engine = llm.engine
    params = StructuredOutputsParams(json=SCHEMA)
    manager = StructuredOutputManager(engine.tokenizer, engine.model_cfg.vocab_size, 1, engine.device)
    start = time.perf_counter()
    manager.compile(params).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(params).result()
    return cold, time.perf_counter() - start


def time_both(llm, requests: list[BenchRequest], temperature: float, sync) -> dict:
    """Time the constrained arm, then the unconstrained one on the same output lengths. Returns the metrics."""
    from heron.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=SCHEMA)
    cold, cached = compile_times(llm)
    prompts = [r.prompt_token_ids for r in requests]

    def timed(params: list[SamplingParams]) -> tuple[float, list[int]]:
        if not llm.reset_prefix_cache():  # each arm computes its prompts (they would be the second one's cache hits)
            raise RuntimeError("The prefix cache could not be reset: requests are still running.")
        sync(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm)
        return time.perf_counter() - start, [len(o.outputs[0].token_ids) for o in outs]

    llm.generate([list(range(1, 33))], SamplingParams(max_tokens=16, structured_outputs=constraint), use_tqdm=False)
    constrained = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.output_len, structured_outputs=constraint)
        for r in requests
    ]
    s_seconds, lengths = timed(constrained)
    free = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in lengths]
    u_seconds, free_lengths = timed(free)
    if free_lengths != lengths:
        raise RuntimeError("The unconstrained arm did not generate the constrained arm's output lengths.")
    tokens = sum(lengths)
    return {
        "output_tokens_per_s": tokens / s_seconds,
        "unconstrained_output_tokens_per_s": tokens / u_seconds,
        "ratio_vs_unconstrained": u_seconds / s_seconds,
        "elapsed_s": s_seconds,
        "unconstrained_elapsed_s": u_seconds,
        "output_tokens": tokens,
        "num_requests": len(requests),
        "requests_closed_by_grammar": sum(n < r.output_len for n, r in zip(lengths, requests)),
        "compile_cold_s": cold,
        "compile_cached_s": cached,
    }
