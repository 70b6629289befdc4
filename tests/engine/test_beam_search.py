"""Beam search (heron/engine/beam_search.py) against transformers' `generate(num_beams=k, do_sample=False)`:
the same beams in the same order, with EOS ending some of them (the token the model picks most is made its
EOS), under each length penalty and early-stopping rule; and the beams share the prompt's blocks."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
import torch

from heron import LLM
from heron.engine.request import SequenceStatus
from heron.sampling_params import BeamSearchParams, SamplingParams
from tests.models.test_parity import PROMPTS

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama, its transformers twin, and an EOS token its beams meet within a few steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    greedy = Counter()
    for prompt in PROMPTS[:3]:
        ids = tok(prompt, return_tensors="pt").input_ids
        greedy.update(model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist())
    eos = greedy.most_common(1)[0][0]
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), path)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": eos}, f)
    llm = LLM(str(path), kv_cache_memory=16 << 20, block_size=4)
    return llm, model, tok, eos


def hf_beams(model, tok, prompt: str, k: int, eos: int, length_penalty: float, early_stopping) -> list[list[int]]:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids,
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    beams = []
    for row in out.tolist():  # padded after its EOS with more EOS tokens
        gen = row[ids.shape[1] :]
        beams.append(row[: ids.shape[1]] + (gen[: gen.index(eos) + 1] if eos in gen else gen))
    return beams


@pytest.mark.parametrize(
    "k, length_penalty, early_stopping",
    [(1, 1.0, False), (3, 1.0, False), (4, 0.0, False), (3, 2.0, "never"), (4, -1.0, True)],
)
def test_beams_match_transformers(tiny, k, length_penalty, early_stopping):
    llm, model, tok, eos = tiny
    params = BeamSearchParams(
        beam_width=k,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        include_stop_str_in_output=True,
    )
    outs = llm.beam_search([{"prompt": p} for p in PROMPTS[:3]], params)
    ended_by_eos = 0
    for prompt, out in zip(PROMPTS, outs):
        assert [s.tokens for s in out.sequences] == hf_beams(model, tok, prompt, k, eos, length_penalty, early_stopping)
        ended_by_eos += sum(s.finish_reason == "stop" for s in out.sequences)
    assert ended_by_eos or length_penalty > 1  # the EOS rules were exercised (a high penalty favours long beams)


def test_eos_is_left_out_unless_asked_and_ignore_eos_runs_to_max_tokens(tiny):
    llm, _, tok, eos = tiny
    (out,) = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS))  # meets EOS
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and all(eos not in s.tokens for s in stopped)
    assert out.sequences[0].text == tok.decode(out.sequences[0].tokens)
    (out,) = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True))
    n = len(tok(PROMPTS[0]).input_ids)
    assert [len(s.tokens) - n for s in out.sequences] == [MAX_TOKENS] * 2
    assert [s.finish_reason for s in out.sequences] == ["length"] * 2


def test_beams_share_the_prompt_blocks(tiny):
    """The prompt's full blocks are computed once and referenced by every beam: while 4 beams run, the
    cache holds the prompt's full blocks once, plus at most a few tail blocks per beam."""
    llm, _, tok, _ = tiny
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = tok(PROMPTS[2]).input_ids  # 20-odd tokens: several full blocks of 4
    params = SamplingParams(n=4, max_tokens=6, beam_search=BeamSearchParams(4, 6, ignore_eos=True))
    req = engine.add_request("beams", prompt, params)
    used_at_most = 0
    full = len(prompt) // bm.block_size
    while not req.is_finished:
        engine.step()
        live = [s for s in req.seqs if s.status is SequenceStatus.RUNNING]
        if len(live) == 4:
            assert len({tuple(s.block_table[:full]) for s in live}) == 1  # one copy of the prompt's full blocks
            assert all(bm.ref_count[b] == 4 for b in live[0].block_table[:full])
            used_at_most = max(used_at_most, bm.num_blocks - bm.num_free_blocks)
    assert 0 < used_at_most <= full + 4 * 3  # per beam: the prompt's partial block and its new tokens
    assert len(req.seqs) == 4 and all(s.is_finished for s in req.seqs)
    assert not engine.has_unfinished()


def test_bad_beam_params_are_value_errors(tiny):
    llm = tiny[0]
    for kwargs in (dict(beam_width=0), dict(beam_width=11), dict(temperature=0.5), dict(early_stopping="soon")):
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="n \\(3\\) must be at most"):
        llm.generate("hi", SamplingParams(n=3, beam_search=BeamSearchParams(2, 4)))


@pytest.mark.slow
def test_embedded_model_beams_match_transformers(embedded_llm):
    from transformers import LlamaConfig, LlamaForCausalLM

    from heron.models.gguf_loader import load_gguf
    from heron.models.loader import embedded_model_path

    source = load_gguf(embedded_model_path())
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in source.hf_config.items() if k != "architectures"}))
    model.load_state_dict(dict(source.weights()), strict=False)
    model.tie_weights()
    tok = embedded_llm.get_tokenizer()
    eos = embedded_llm.engine.eos_token_ids[0]
    chat = [{"role": "user", "content": "Say hi."}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, include_stop_str_in_output=True)
    (out,) = embedded_llm.beam_search({"prompt_token_ids": tok(prompt).input_ids}, params)
    ids = tok(prompt).input_ids
    theirs = hf_beams(model.eval(), tok, prompt, 3, eos, 1.0, False)
    assert theirs[0][: len(ids)] == ids
    assert [s.tokens for s in out.sequences] == theirs
