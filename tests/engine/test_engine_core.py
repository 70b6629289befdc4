"""The engine process's wire format: DELTA outputs, sent as tuples and folded back on the API side, give
the same cumulative outputs as the engine's own CUMULATIVE ones, step by step."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from heron.engine.engine_core import OutputAccumulator, to_wire
from heron.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


def test_folded_deltas_equal_cumulative_outputs(embedded_llm):
    engine = embedded_llm.engine
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12, logprobs=2, stop=["fruitless"])
    engine.add_request("cumulative", "Write a list of fruits:", params)
    engine.add_request("delta", "Write a list of fruits:", replace(params, output_kind=RequestOutputKind.DELTA))
    acc, steps = OutputAccumulator(), 0
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
        assert ("delta" in outs) == ("cumulative" in outs)
        if "delta" not in outs:
            continue
        acc.add(pickle.loads(pickle.dumps(to_wire(outs["delta"]))))
        got, want = acc.snapshot(), outs["cumulative"]
        assert got.finished == want.finished and got.prompt_token_ids == want.prompt_token_ids
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert (g.index, g.text, g.token_ids, g.finish_reason) == (w.index, w.text, w.token_ids, w.finish_reason)
            assert g.logprobs == w.logprobs and g.cumulative_logprob == pytest.approx(w.cumulative_logprob)
        steps += 1
    assert steps > 2 and got.finished
