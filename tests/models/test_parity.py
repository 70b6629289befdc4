"""Heron against Hugging Face transformers on the same weights: greedy tokens and fp32 logits."""

from __future__ import annotations

import os

import pytest
import torch

from heron import LLM, SamplingParams
from heron.models.gguf_loader import load_gguf
from heron.models.loader import embedded_model_path
from tests.conftest import SLIDING_WINDOW

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "Once upon a time, in a land far away, there lived a heron who fished in the river every morning",
    "1 2 3",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(model, tok, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:  # one at a time: no padding effects on the reference
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_dir(arch)
            cache[arch] = (
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(path),
                path,
            )
        return cache[arch]

    return get


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_greedy_matches_transformers_on_a_mixed_batch(arch, hf_tiny):
    model, tok, path = hf_tiny(arch)
    llm = LLM(path, kv_cache_memory=32 << 20)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, tok, PROMPTS, 12)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mistral", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_fp32_logits_match_transformers(arch, hf_tiny):
    model, tok, path = hf_tiny(arch)
    llm = LLM(path, kv_cache_memory=32 << 20)
    captured = []
    runner_model = llm.engine.runner.model
    compute = runner_model.compute_logits
    runner_model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    gen = ids[0].tolist() + []
    with torch.no_grad():
        ref_prefill = model(ids).logits[0, -1]
    ours = captured[0][0]
    assert (ours - ref_prefill).norm() / ref_prefill.norm() < 1e-4
    # the decode steps too: feed the tokens Heron chose
    outs = llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    gen = torch.tensor([ids[0].tolist() + outs[0].outputs[0].token_ids[:2]])
    with torch.no_grad():
        ref_last = model(gen).logits[0, -1]
    assert (captured[-1][0] - ref_last).norm() / ref_last.norm() < 1e-4


LONG_PROMPT = " ".join(PROMPTS[2:] * 2)  # ~50 tokens: six windows of the tiny configs' 8


def capture_logits(llm) -> list:
    """The logits of each step that samples, as the engine computes them (a prompt's chunks before its last
    compute none)."""
    captured, model = [], llm.engine.runner.model
    compute = model.compute_logits

    def record(hidden, out=None):
        logits = compute(hidden, out)
        if len(logits):
            captured.append(logits.clone())
        return logits

    model.compute_logits = record
    return captured


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert (ours - ref).norm() / ref.norm() < 1e-4


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3-longrope"])
def test_past_the_sliding_window_in_chunks_that_cross_its_edge(arch, hf_tiny):
    """A prompt six windows long, prefilled in chunks of 6 tokens (each chunk's queries see keys across the window
    edge of the 8-token window, some in earlier chunks), then decoded: greedy ids and fp32 logits as transformers'.
    (Phi-3 with LongRoPE: past its 32-token original context, where both use the long factors.)"""
    model, tok, path = hf_tiny(arch)
    llm = LLM(path, kv_cache_memory=32 << 20, max_num_batched_tokens=6, max_num_seqs=2)
    ids = tok(LONG_PROMPT, return_tensors="pt").input_ids
    assert ids.shape[1] > 6 * SLIDING_WINDOW
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    both = [LONG_PROMPT, " ".join(PROMPTS * 2)]  # (both past LongRoPE's 32 tokens)
    out = llm.generate(both, params, use_tqdm=False)  # scheduled side by side
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(model, tok, both, 8)
    captured = capture_logits(llm)
    llm.generate([ids[0].tolist()], params, use_tqdm=False)  # alone: one row per step
    full = torch.tensor([ids[0].tolist() + out[0].outputs[0].token_ids])
    with torch.no_grad():
        ref = model(full).logits[0, ids.shape[1] - 1 : -1]  # after the prompt, and after each decoded token
    assert len(captured) == len(ref) == 8
    for ours, want in zip(captured, ref):
        assert_logits_close(ours[0], want)


def test_mistral_runs_in_a_pool_smaller_than_its_sequences(hf_tiny):
    """Blocks out of every layer's window are released as the sequence moves on (block_manager.py): a pool of
    8 blocks of 4 tokens serves two sequences of ~90 tokens each, as transformers computes them."""
    model, tok, path = hf_tiny("mistral")
    llm = LLM(
        path,
        block_size=4,
        max_num_batched_tokens=6,
        max_num_seqs=2,
        kv_cache_memory=8 * llm_bytes_per_block(path, block_size=4),
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    both = [LONG_PROMPT, " ".join(PROMPTS * 2)]
    out = llm.generate(both, params, use_tqdm=False)
    assert llm.engine.block_manager.num_blocks == 8
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(model, tok, both, 40)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_count)


def test_chunked_prefill_gives_the_same_tokens(hf_tiny):
    model, tok, path = hf_tiny("llama")
    llm = LLM(path, kv_cache_memory=32 << 20, max_num_batched_tokens=8, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, tok, PROMPTS, 12)


def test_prefix_cache_hits_give_the_same_tokens(hf_tiny):
    model, tok, path = hf_tiny("llama")
    llm = LLM(path, kv_cache_memory=32 << 20, block_size=4)
    long_prompt = PROMPTS[2]
    first = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate([long_prompt, long_prompt + " and"], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in again)
    ref = hf_greedy(model, tok, [long_prompt, long_prompt + " and"], 12)
    assert [o.outputs[0].token_ids for o in again] == ref
    assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("swap_space", [0, 0.001])
def test_preemption_by_a_tiny_kv_pool_gives_the_same_tokens(hf_tiny, swap_space):
    model, tok, path = hf_tiny("llama")
    # 16 blocks of 4 tokens = 64 token slots for 4 sequences that grow to ~40 tokens each
    llm = LLM(
        path,
        block_size=4,
        max_model_len=64,
        swap_space=swap_space,
        kv_cache_memory=16 * llm_bytes_per_block(path, block_size=4),
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, tok, PROMPTS, 20)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_count)


def llm_bytes_per_block(path: str, block_size: int) -> int:
    import json

    cfg = json.load(open(os.path.join(path, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4


@pytest.mark.slow
def test_embedded_gguf_model_matches_transformers(embedded_llm):
    """transformers' Llama on the tensors our GGUF loader dequantizes (tests/models/test_gguf_loader.py
    checks those against transformers' own GGUF reading; its model loader would need `accelerate`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = load_gguf(embedded_model_path())
    cfg = LlamaConfig(**{k: v for k, v in source.hf_config.items() if k != "architectures"})
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(dict(source.weights()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    outs = embedded_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, embedded_llm.get_tokenizer(), PROMPTS, 12)
