"""Steps run in captured CUDA graphs give what eager steps give: prompts at and around the prefill graphs'
token buckets, prompt logprobs through a graph step, a decode beside a new prompt in one step, chunked prefill,
and many short requests (decode rows beside new prompts in the mixed graphs). On the GPU the graph engine
captures and replays against an enforce_eager one; on the CPU (no graphs) its steps are padded to the same
graphs' counts and run eagerly, which checks the padding and the logits rows of graph steps against unpadded
steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron import LLM, SamplingParams
from heron.executor.graph_keys import GraphKeys
from heron.models.loader import ModelSource

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captures CUDA graphs)"),
        ],
    ),
]
# prompt length -> the graph its one prefill step runs in (a decode graph for one token; eager past 512)
LENGTHS = {
    1: (1, 1, 1),
    15: (16, 8, 16),
    16: (16, 8, 16),
    17: (32, 8, 32),
    100: (128, 8, 128),
    128: (128, 8, 128),
    300: (512, 8, 512),
    512: (512, 8, 512),
    513: None,
}


@pytest.fixture(scope="module")
def source() -> ModelSource:
    """A 2-layer Qwen3 with the real head_dim and GQA, random weights wide enough for clear greedy choices."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    weights = model.state_dict()
    return ModelSource(
        name="tiny-qwen3", hf_config=cfg.to_dict(), weights=lambda: iter(weights.items()), tokenizer=None
    )


def _engines(source: ModelSource, device: str, **kw) -> tuple[LLM, LLM, list]:
    """The graph engine, its eager reference, and the list the graph engine records its steps in: (graph
    key or None, the kinds of its real rows)."""
    common = dict(dtype="float32", device=device, max_num_seqs=8, kv_cache_memory=256 << 20) | kw
    graphs, eager = LLM(source, **common), LLM(source, enforce_eager=True, **common)
    runner = graphs.engine.runner
    if device == "cpu":
        sched = graphs.engine.config.scheduler
        runner.graph_keys = GraphKeys.plan(sched.max_num_seqs, sched.max_num_batched_tokens, prefill=True)
    else:
        assert runner.graphs and not eager.engine.runner.graphs
    steps, forward = [], runner.run_forward

    def run_forward(arrays, graph, meta, logits_rows):
        q_lens = np.diff(meta.query_start_loc_cpu.numpy())
        steps.append((graph, {"decode" if n == 1 else "chunk" for n in q_lens.tolist() if n}))
        assert graph is None or device == "cpu" or graph in runner.graphs
        return forward(arrays, graph, meta, logits_rows)

    runner.run_forward = run_forward
    return graphs, eager, steps


def _assert_same(got, want) -> None:
    """Equal tokens; prompt logprobs equal in their tokens and close in value."""
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
    for a, b in zip(got.prompt_logprobs or [], want.prompt_logprobs or []):
        assert (a is None) == (b is None)
        if a is not None:
            assert list(a) == list(b)
            assert np.allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_prompts_around_the_buckets(source, device):
    graphs, eager, steps = _engines(source, device)
    gen = np.random.default_rng(0)
    for n, key in LENGTHS.items():
        prompt = gen.integers(2, 2048, n).tolist()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2 if n == 100 else None)
        steps.clear()
        got, want = (llm.generate(prompt, params, use_tqdm=False)[0] for llm in (graphs, eager))
        _assert_same(got, want)
        assert [graph for graph, _ in steps] == [key] + [(1, 1, 1)] * 3  # then batch-1 decode graphs


@pytest.mark.parametrize("device", DEVICES)
def test_a_decode_beside_new_prompts_and_chunked_prefill(source, device):
    """A 64-token budget: a running decode shares steps with the chunks of a 150-token prompt and a short
    prompt asking for prompt logprobs, every step in a graph of 64 tokens or less."""
    graphs, eager, steps = _engines(source, device, max_num_batched_tokens=64)
    gen = np.random.default_rng(1)
    first, long, short = (gen.integers(2, 2048, n).tolist() for n in (10, 150, 5))
    outputs = []
    for llm in (graphs, eager):
        engine, done = llm.engine, {}
        engine.add_request("first", first, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for _ in range(2):  # its prefill, then it decodes
            engine.step()
        engine.add_request("long", long, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.add_request(
            "short", short, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
        )
        while engine.has_unfinished():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        outputs.append(done)
    assert sorted(outputs[0]) == ["first", "long", "short"]
    for rid in outputs[0]:
        _assert_same(outputs[0][rid], outputs[1][rid])
    assert all(key is not None for key, _ in steps)
    assert any(key[0] != key[1] and kinds == {"decode", "chunk"} for key, kinds in steps)  # a mixed graph step


@pytest.mark.parametrize("device", DEVICES)
def test_many_short_requests_run_in_mixed_graphs(source, device):
    """More requests than sequence slots: as sequences finish, new prompts join the running decodes, and
    those steps replay the mixed graphs (every slot; one graph a token count, for chunks of any length)."""
    graphs, eager, steps = _engines(source, device, max_num_seqs=16, max_num_batched_tokens=512)
    gen = np.random.default_rng(2)
    prompts = [gen.integers(2, 2048, n).tolist() for n in gen.integers(3, 90, 40)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in gen.integers(2, 12, 40)]
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (graphs, eager))
    for a, b in zip(got, want):
        _assert_same(a, b)
    mixed = {key for key, kinds in steps if key and key[1] == 16 and kinds == {"decode", "chunk"}}
    assert mixed and all(key[2] == key[0] for key in mixed)
    assert {64} < {key[0] for key in mixed}  # short prompts alone, and longer ones beside them
    assert all(key is not None for key, _ in steps)
