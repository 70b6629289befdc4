"""Structured outputs: the grammar, the bitmask and its application, then the engine on the embedded model
(every output parses and matches its constraint; unconstrained rows of a mixed batch are unchanged)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from heron import SamplingParams
from heron.engine import structured_output
from heron.engine.structured_output import StructuredOutputManager, build_grammar, cache_key
from heron.executor.sampler import apply_token_bitmask
from heron.sampling_params import StructuredOutputsParams as S

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "params, field",
    [
        (S(regex="("), "regex"),
        (S(json={"type": "nope"}), "json"),
        (S(json="{bad"), "json"),
        (S(grammar="x"), "grammar"),
    ],
)
def test_an_invalid_constraint_is_a_value_error_naming_its_field(params, field):
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is invalid"):
        build_grammar(params)


def test_the_cache_key_does_not_depend_on_the_schema_key_order():
    assert cache_key(S(json={"a": 1, "b": 2})) == cache_key(S(json={"b": 2, "a": 1}))


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70
    allowed = torch.rand(3, vocab) < 0.3
    bits = torch.zeros(3, 96, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.reshape(3, 3, 32) << torch.arange(32)).sum(-1)
    mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(3, vocab)
    out = apply_token_bitmask(logits.clone(), mask)
    assert torch.equal(out.isfinite(), allowed)
    assert torch.equal(out[allowed], logits[allowed])


def test_the_matcher_and_its_mask_follow_a_choice(embedded_tokenizer):
    vocab = len(embedded_tokenizer)
    manager = StructuredOutputManager(embedded_tokenizer, vocab, 2, torch.device("cpu"))
    eos = embedded_tokenizer.eos_token_id
    matcher = manager.matcher(manager.compile(S(choice=["yes", "no"])).result(), [eos])
    mask = manager.fill_bitmask([matcher, None])
    logits = apply_token_bitmask(torch.zeros(2, vocab), mask)
    assert logits[1].isfinite().all()  # a row without a grammar
    first = logits[0].isfinite().nonzero()[:, 0].tolist()
    texts = {embedded_tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for t in embedded_tokenizer.encode("no", add_special_tokens=False):
        assert matcher.accept_token(t)
    done = apply_token_bitmask(torch.zeros(1, vocab), manager.fill_bitmask([matcher]))
    assert done[0].isfinite().nonzero()[:, 0].tolist() == [eos]  # the choice is complete: only EOS
    assert matcher.accept_token(eos) and matcher.is_terminated()


def test_stop_tokens_past_the_tokenizer_are_left_to_the_tokenizers_own(embedded_tokenizer):
    """A model's EOS id the tokenizer does not have (a model served with another's tokenizer, as the structured
    benchmark does): the matcher keeps the stop ids it has, and with none of them ends on the tokenizer's EOS."""
    vocab = len(embedded_tokenizer)
    manager = StructuredOutputManager(embedded_tokenizer, vocab + 1000, 2, torch.device("cpu"))
    eos, outside = embedded_tokenizer.eos_token_id, vocab + 500
    compiled = manager.compile(S(choice=["yes"])).result()
    assert manager.matcher(compiled, [outside, eos]).stop_token_ids == [eos]
    alone = manager.matcher(compiled, [outside])
    assert eos in alone.stop_token_ids and outside not in alone.stop_token_ids


def test_batched_accept_and_masks_equal_each_matchers_own_on_padded_logits(embedded_tokenizer, monkeypatch):
    """The manager's accept (xgrammar's batch accept, split between threads) and masks (filled for the tokenizer's
    ids, widened to the logits) against plain matchers on a vocabulary as wide as the logits, as before."""
    monkeypatch.setattr(structured_output, "MIN_ACCEPT_ROWS", 8)  # 24 rows: the accept split between 2 threads
    tok, eos, rows = embedded_tokenizer, embedded_tokenizer.eos_token_id, 24
    vocab = len(tok) + 96  # logits wider than the tokenizer, as a padded embedding makes them
    manager = StructuredOutputManager(tok, vocab, rows + 2, torch.device("cpu"), threads=2)
    assert manager.mask_vocab == len(tok)
    ours = [manager.matcher(manager.compile(S(json=SCHEMA)).result(), [eos]) for _ in range(rows)]
    wide = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    compiled = wide.compile_json_schema(SCHEMA, any_whitespace=False, strict_mode=True)
    refs = [xgr.GrammarMatcher(compiled, override_stop_tokens=[eos]) for _ in range(rows)]
    ref_mask = xgr.allocate_token_bitmask(1, vocab)
    rng = np.random.default_rng(0)
    live, refused = list(range(rows)), 0
    for step in range(40):
        # a row without a grammar (moving, so that its all-ones tail is reset) and a matcher drawn twice
        matchers = [ours[i] for i in live]
        free = step % len(matchers)
        mask = manager.fill_bitmask([*matchers[:free], None, *matchers[free:], matchers[0]]).clone()
        assert (mask[free] == -1).all()
        mask = torch.cat([mask[:free], mask[free + 1 :]])
        assert torch.equal(mask[-1], mask[0])
        tokens = []
        for row, i in enumerate(live):
            refs[i].fill_next_token_bitmask(ref_mask)
            assert torch.equal(mask[row], ref_mask[0]), (step, i)
            allowed = np.flatnonzero(np.unpackbits(ref_mask[0].numpy().view(np.uint8), bitorder="little"))
            if row == 0 and step % 8 == 7:  # a token the grammar refuses
                tokens.append(int(rng.choice(np.setdiff1d(np.arange(len(tok)), allowed))))
                refused += 1
            else:
                tokens.append(eos if eos in allowed and rng.random() < 0.3 else int(rng.choice(allowed)))
        done = manager.accept([ours[i] for i in live], tokens)
        assert done == [not refs[i].accept_token(t) or refs[i].is_terminated() for i, t in zip(live, tokens)]
        live = [i for i, d in zip(live, done) if not d]
    closed = sum(m.is_terminated() for m in ours)
    assert closed > 3 and rows - closed - len(live) == refused and live  # closed, refused, going on


def _texts(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_regex_and_choice_outputs_match_and_free_rows_are_unchanged(embedded_llm):
    free = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
    json_params = [SamplingParams(seed=s, max_tokens=60, structured_outputs=S(json=SCHEMA)) for s in range(6)]
    regex = SamplingParams(seed=1, max_tokens=20, structured_outputs=S(regex=r"\d{4}-\d{2}-\d{2}"))
    choice = SamplingParams(seed=2, n=2, max_tokens=10, structured_outputs=S(choice=["red", "green", "blue"]))
    prompts = ["A person as JSON:"] * 6 + ["Today's date:", "A color:", "Hello, my name is"]
    outs = _texts(embedded_llm, prompts, [*json_params, regex, choice, free])
    for (o,) in outs[:6]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[6][0].text)
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in outs[7])
    # the unconstrained row draws the same tokens as without the constrained ones beside it
    alone = _texts(embedded_llm, prompts[-1:], [free])[0][0]
    assert outs[8][0].token_ids == alone.token_ids


@pytest.mark.parametrize("thread_rows, fill_thread", [(1, "heron-grammar-fill"), (None, "MainThread")])
def test_a_grammar_steps_draw_waits_until_the_next_step_is_prepared(
    embedded_llm, monkeypatch, thread_rows, fill_thread
):
    """Step t + 1's host work (scheduling, inputs) overlaps step t's forward pass: step t's sampling, which
    waits for its masks (filled on their own thread meanwhile, or at once for a step of fewer rows than
    MIN_THREAD_FILL_ROWS), is launched after step t + 1 is prepared, then step t + 1's forward."""
    if thread_rows is not None:
        monkeypatch.setattr(structured_output, "MIN_THREAD_FILL_ROWS", thread_rows)
    runner, calls, fills = embedded_llm.engine.runner, [], []
    for name in ("prepare", "launch", "sample"):
        method = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _m=method, _c=name[0]: (calls.append(_c), _m(*a))[1])
    params = SamplingParams(seed=3, max_tokens=6, structured_outputs=S(regex=r"[a-z]{40}"))
    embedded_llm.generate(["x"], params, use_tqdm=False)  # (the manager exists from here on)
    manager, calls[:] = embedded_llm.engine._structured, []
    fill = manager.fill_bitmask
    monkeypatch.setattr(manager, "fill_bitmask", lambda m: (fills.append(threading.current_thread().name), fill(m))[1])
    [[out]] = _texts(embedded_llm, ["Letters:"], [params])
    assert re.fullmatch("[a-z]+", out.text) and len(out.token_ids) == 6
    # prefill, then five decode steps each drawing the step before's tokens; the last draw ends the request
    assert "".join(calls) == "pl" + "psl" * 5 + "s"
    # each step's masks are filled on the manager's thread while the main one schedules the next step (a step
    # of one row: on the main thread, at once)
    assert len(fills) == 6 and all(name.startswith(fill_thread) for name in fills)


def test_a_grammar_step_whose_tokens_the_next_needs_draws_at_once_and_an_abort_mid_step_is_clean(
    embedded_llm, monkeypatch
):
    """Penalties need each step's tokens on the host before the next: such a grammar step fills its masks and
    draws before returning. A request aborted while its grammar step waits for its draw leaves the engine
    clean, and the request beside it finishes under its constraint."""
    engine, calls = embedded_llm.engine, []
    with monkeypatch.context() as patch:
        for name in ("prepare", "launch", "sample"):
            method = getattr(engine.runner, name)
            patch.setattr(engine.runner, name, lambda *a, _m=method, _c=name[0]: (calls.append(_c), _m(*a))[1])
        penalized = SamplingParams(max_tokens=4, repetition_penalty=1.3, structured_outputs=S(regex=r"[a-z]{40}"))
        [[out]] = _texts(embedded_llm, ["Letters:"], [penalized])
    assert re.fullmatch("[a-z]+", out.text) and "".join(calls) == "pls" * 4
    params = SamplingParams(seed=5, max_tokens=8, structured_outputs=S(regex=r"[0-9]{40}"))
    engine.add_request("gone", engine.tokenize("Digits:"), params)
    engine.add_request("kept", engine.tokenize("Digits:"), params)
    while engine._unsampled is None:
        engine.step()
    engine.abort("gone")
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert "gone" not in outputs and re.fullmatch("[0-9]+", outputs["kept"].outputs[0].text)
    assert engine._unsampled is None and engine._inflight is None and not engine.requests


def test_an_invalid_constraint_is_refused_and_the_engine_goes_on(embedded_llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        embedded_llm.generate(["x"], SamplingParams(structured_outputs=S(regex="(")), use_tqdm=False)
    out = _texts(embedded_llm, ["Yes or no?"], [SamplingParams(structured_outputs=S(choice=["yes", "no"]))])[0][0]
    assert out.text in ("yes", "no")
