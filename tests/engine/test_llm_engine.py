"""The pipelined engine step (step t launched before step t - 1's tokens are read back): tokens still on the
device never show in outputs, streamed and final-only runs agree, a sequence that ends while a later step of it is in
flight neither loses nor gains tokens, and blocks completed by a then-pending token still enter the
prefix cache."""

from __future__ import annotations

import pytest

from heron import SamplingParams
from heron.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def add(a, b):"]


def _stream(engine, prompts, params) -> dict[str, list]:
    """Every output the engine returns, per request, until all are done."""
    seen: dict[str, list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params[i] if isinstance(params, list) else params)
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_streamed_outputs_never_show_a_pending_token_and_match_final_only(embedded_llm):
    engine = embedded_llm.engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    streamed = _stream(engine, PROMPTS, params)
    vocab = engine.model_cfg.vocab_size
    for outs in streamed.values():
        for before, after in zip(outs, outs[1:]):
            ids = before.outputs[0].token_ids
            assert all(0 <= t < vocab for t in ids) and after.outputs[0].token_ids[: len(ids)] == ids
            assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 24
    final = embedded_llm.generate(PROMPTS, params, use_tqdm=False)  # FINAL_ONLY: text decoded once at the end
    for i, out in enumerate(final):
        last = streamed[f"s{i}"][-1].outputs[0]
        assert out.outputs[0].token_ids == last.token_ids and out.outputs[0].text == last.text


def test_a_stop_token_ending_a_sequence_mid_pipeline(embedded_llm):
    """The stopped sequence's extra row (sampled while its stop token was still on the GPU) is dropped,
    and the sequences beside it are unaffected."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = embedded_llm.generate(PROMPTS, greedy, use_tqdm=False)
    stop_at = alone[0].outputs[0].token_ids[5]
    first = alone[0].outputs[0].token_ids
    stopped = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_at])
    outs = embedded_llm.generate(PROMPTS, [stopped] + [greedy] * 3, use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    assert c.token_ids == first[: first.index(stop_at) + 1]
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in alone[1:]]


def test_generated_blocks_enter_the_prefix_cache(embedded_llm):
    engine = embedded_llm.engine
    bs = engine.block_manager.block_size
    prompt = engine.tokenize("Write a long story about a heron that learns to fish in a river.")
    out = embedded_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4 * bs, ignore_eos=True), use_tqdm=False
    )[0]
    follow_up = prompt + out.outputs[0].token_ids + engine.tokenize(" The end.", add_special_tokens=False)
    hits = engine.block_manager.prefix_hits
    embedded_llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    # every full block of prompt + output was cached, including those whose last token was pending when
    # the block's step ran
    assert engine.block_manager.prefix_hits - hits == (len(prompt) + 4 * bs - 1) // bs * bs


def test_reset_prefix_cache_makes_the_same_prompt_compute_again(embedded_llm):
    engine = embedded_llm.engine
    prompt = engine.tokenize("A heron stands in the shallows, waiting for a fish to come close enough to catch.")
    params = SamplingParams(temperature=0, max_tokens=2)
    first = embedded_llm.generate([prompt], params, use_tqdm=False)[0]
    hits = engine.block_manager.prefix_hits
    assert embedded_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.block_manager.prefix_hits > hits  # the second run found the first's blocks
    assert embedded_llm.reset_prefix_cache()
    hits = engine.block_manager.prefix_hits
    again = embedded_llm.generate([prompt], params, use_tqdm=False)[0]
    assert engine.block_manager.prefix_hits == hits and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_final_only_returns_nothing_until_the_end(embedded_llm):
    engine = embedded_llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = _stream(engine, PROMPTS[:2], params)
    assert all(len(o) == 1 and o[0].finished for o in outs.values())


def test_a_text_prompt_with_its_ids_is_not_tokenized_again_and_still_validated(embedded_llm):
    engine = embedded_llm.engine
    ids = engine.tokenize("Tokenized elsewhere, with one more token:") + [42]
    params = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("given-ids", "the text the client sent", params, prompt_token_ids=ids)
    [out] = _stream(engine, [], params)["given-ids"]
    assert out.prompt == "the text the client sent" and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == embedded_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for bad, match in [
        ([], "empty"),
        ([engine.model_cfg.vocab_size], "must be in"),
        ([1] * engine.max_model_len, str(engine.max_model_len)),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", "text", params, prompt_token_ids=bad)
    assert not engine.has_unfinished() and "bad" not in engine.requests


def test_a_token_on_the_device_is_counted_but_not_in_token_ids(embedded_llm):
    engine = embedded_llm.engine
    engine.add_request("pending", "Count to ten:", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.requests["pending"].seqs[0]
    p = seq.num_prompt_tokens
    assert not engine.advance()  # the prompt's step is launched; its token stays on the device
    assert (len(seq.token_ids), seq.num_pending, seq.num_tokens, seq.num_computed_tokens) == (p, 1, p + 1, p)
    engine.advance()  # the next step takes that token as input on the device; then the first is read back
    assert (len(seq.token_ids), seq.num_pending, seq.num_tokens, seq.num_computed_tokens) == (p + 1, 1, p + 2, p + 1)
    while engine.has_unfinished():
        engine.advance()
    assert (len(seq.output_token_ids), seq.num_pending, seq.finish_reason) == (4, 0, "length")
