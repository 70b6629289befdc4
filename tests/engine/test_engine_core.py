"""The engine process's messages: a request's deltas, pickled as they cross the pipe and assembled on the
API side, give the engine's own outputs step by step (CUMULATIVE), and DELTA outputs that add up to them."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from heron.engine.detokenizer import LogprobTexts
from heron.engine.engine_core import request_delta
from heron.engine.messages import AddRequest, CompletionDelta, RequestDelta, StepOutputs
from heron.engine.output_assembler import OutputAssembler
from heron.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


def _through_the_pipe(msg):
    return pickle.loads(pickle.dumps(msg))


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_assembled_deltas_equal_the_engines_outputs(embedded_llm, prompt_kind):
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
    head = ("delta", text if prompt_kind == "text" else None, ids)
    texts = LogprobTexts(engine.tokenizer)  # the Logprob objects' maker, as AsyncLLM's
    cumulative = OutputAssembler(*head, RequestOutputKind.CUMULATIVE, texts)
    deltas = OutputAssembler(*head, RequestOutputKind.DELTA, texts)
    final = OutputAssembler(*head, RequestOutputKind.FINAL_ONLY, texts)
    summed: dict[int, list] = {}
    steps = 0
    while engine.has_unfinished():
        advanced = {r.request_id: r for r in engine.advance()}
        assert ("delta" in advanced) == ("cumulative" in advanced)
        if "delta" not in advanced:
            continue
        msg = _through_the_pipe(StepOutputs([request_delta(advanced["delta"], engine.output_processor)], None))
        for a in (cumulative, deltas, final):
            a.add(msg.deltas[0])
        got, want = cumulative.take(), engine.output_processor.make_output(advanced["cumulative"])
        assert (got.request_id, got.prompt, got.prompt_token_ids) == ("delta", want.prompt, want.prompt_token_ids)
        assert got.finished == want.finished and got.prompt_logprobs == want.prompt_logprobs
        assert got.metrics == advanced["delta"].metrics
        assert got.num_cached_tokens == advanced["delta"].seqs[0].num_cached_tokens
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert (g.index, g.text, g.token_ids, g.finish_reason) == (w.index, w.text, w.token_ids, w.finish_reason)
            assert g.logprobs == w.logprobs and g.cumulative_logprob == pytest.approx(w.cumulative_logprob)
        for c in deltas.take().outputs:  # a sample's finish is said once
            assert summed.setdefault(c.index, ["", [], [], None])[3] is None
            summed[c.index][0] += c.text
            summed[c.index][1] += c.token_ids
            summed[c.index][2] += c.logprobs
            summed[c.index][3] = c.finish_reason
        assert final.ready() == got.finished
        steps += 1
    assert steps > 2 and got.finished and got.prompt_logprobs and len(got.outputs) == 2
    assert got.metrics.finished_time is not None
    assert summed == {g.index: [g.text, g.token_ids, g.logprobs, g.finish_reason] for g in got.outputs}
    assert final.take().outputs == got.outputs


def _delta(finished: bool, completions: list[tuple], first: bool = False) -> RequestDelta:
    times = (1.0, 2.0, 3.0, 4.0, 5.0 if finished else None)
    return RequestDelta(("r", finished, times, completions, first, None, 3 if first else 0, None))


def test_delta_outputs_merge_what_arrived_since_the_last_read():
    a = OutputAssembler("r", "p", [1, 2], RequestOutputKind.DELTA)
    a.add(_delta(False, [(0, "a", [5], None, None, None, None)], first=True))
    first = a.take()
    assert (first.prompt, first.prompt_token_ids, first.num_cached_tokens) == ("p", [1, 2], 3)
    a.add(_delta(False, [(0, "b", [6], None, None, None, None)]))
    a.add(_delta(False, [(0, "c", [7], None, None, "stop", 7)]))
    a.add(_delta(True, [(0, "", [], None, None, "stop", 7)]))  # a finish already said
    [c] = (later := a.take()).outputs
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("bc", [6, 7], "stop", 7)
    assert later.finished and later.prompt is None and later.prompt_token_ids == []
    assert not a.ready()


def test_cumulative_outputs_are_new_objects():
    """A reader holding an output across an await must not see it grow."""
    a = OutputAssembler("r", "p", [1, 2], RequestOutputKind.CUMULATIVE)
    a.add(_delta(False, [(0, "a", [5], None, None, None, None)], first=True))
    before = a.take()
    a.add(_delta(True, [(0, "b", [6], None, None, "length", None)]))
    after = a.take()
    assert (before.outputs[0].text, before.outputs[0].token_ids, before.finished) == ("a", [5], False)
    c = after.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("ab", [5, 6], "length")
    assert after.metrics.finished_time == 5.0 and after.prompt_token_ids == [1, 2] and after.prompt == "p"


def test_step_outputs_cross_the_pipe_as_plain_tuples():
    delta = _delta(True, [(0, "a", [5], -0.5, None, "stop", 7)], first=True)
    data = pickle.dumps(StepOutputs([delta], None))
    assert b"RequestDelta" not in data  # rows go as tuples, typed again on arrival
    [got] = pickle.loads(data).deltas
    assert type(got) is RequestDelta and got == delta and got.request_id == "r" and got.num_cached_tokens == 3
    c = CompletionDelta(got.completions[0])
    assert (c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, c.stop_reason) == (
        0,
        "a",
        [5],
        -0.5,
        "stop",
        7,
    )
    msg = AddRequest("r", "hi", [1, 2], SamplingParams(max_tokens=3), 0, True)
    assert pickle.loads(pickle.dumps(msg)) == msg
