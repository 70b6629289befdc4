"""The engine process's wire format: DELTA outputs, sent as tuples and folded back on the API side, give
the same cumulative outputs as the engine's own CUMULATIVE ones, step by step."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from heron.engine.engine_core import OutputAccumulator, to_wire
from heron.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_folded_deltas_equal_cumulative_outputs(embedded_llm, prompt_kind):
    engine = embedded_llm.engine
    params = SamplingParams(
        n=2, temperature=0.9, seed=5, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=["fruitless"]
    )
    text = "Write a list of fruits:"
    ids = engine.tokenize(text)
    prompt = text if prompt_kind == "text" else ids
    engine.add_request("cumulative", prompt, params)
    # as the engine process gets it: a text prompt comes with the ids the API process made
    engine.add_request(
        "delta",
        prompt,
        replace(params, output_kind=RequestOutputKind.DELTA),
        prompt_token_ids=ids if prompt_kind == "text" else None,
    )
    acc, steps = OutputAccumulator("delta", text if prompt_kind == "text" else None, ids), 0
    while engine.has_unfinished():
        advanced = {r.request_id: r for r in engine.advance()}
        assert ("delta" in advanced) == ("cumulative" in advanced)
        if "delta" not in advanced:
            continue
        acc.add(pickle.loads(pickle.dumps(to_wire(advanced["delta"], engine.output_processor))))
        got, want = acc.snapshot(), engine.output_processor.make_output(advanced["cumulative"])
        assert (got.request_id, got.prompt, got.prompt_token_ids) == ("delta", want.prompt, want.prompt_token_ids)
        assert got.finished == want.finished and got.prompt_logprobs == want.prompt_logprobs
        assert got.metrics == advanced["delta"].metrics
        assert got.num_cached_tokens == advanced["delta"].seqs[0].num_cached_tokens
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert (g.index, g.text, g.token_ids, g.finish_reason) == (w.index, w.text, w.token_ids, w.finish_reason)
            assert g.logprobs == w.logprobs and g.cumulative_logprob == pytest.approx(w.cumulative_logprob)
        steps += 1
    assert steps > 2 and got.finished and got.prompt_logprobs and len(got.outputs) == 2
    assert got.metrics.finished_time is not None


def test_snapshots_are_new_objects():
    """A reader holding a snapshot across an await must not see it grow."""
    acc = OutputAccumulator("r", "p", [1, 2])
    acc.add(("r", False, (1.0, 2.0, 3.0, 3.0, None), [(0, "a", [5], None, None, None, None)], (None, 0)))
    before = acc.snapshot()
    acc.add(("r", True, (1.0, 2.0, 3.0, 4.0, 5.0), [(0, "b", [6], None, None, "length", None)], None))
    after = acc.snapshot()
    assert (before.outputs[0].text, before.outputs[0].token_ids, before.finished) == ("a", [5], False)
    c = after.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("ab", [5, 6], "length")
    assert after.metrics.finished_time == 5.0 and after.prompt_token_ids == [1, 2] and after.prompt == "p"
