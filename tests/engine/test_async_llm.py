"""The asyncio front: streaming, errors before the first output, cancellation frees the request."""

from __future__ import annotations

import asyncio

import pytest

from heron.engine.async_llm import AsyncLLM
from heron.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def async_llm(embedded_llm):
    engine = AsyncLLM(embedded_llm.engine)
    yield engine
    engine.shutdown()


def test_streams_cumulative_outputs_to_the_same_result(async_llm, embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # The offline reference first: both fronts share one engine, and only one may drive it at a time.
    offline = embedded_llm.generate("The weather today", params, use_tqdm=False)[0].outputs[0]

    async def run():
        return [out async for out in async_llm.generate("The weather today", params, "s1")]

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].outputs[0].token_ids == offline.token_ids and texts[-1] == offline.text


def test_invalid_request_raises_before_any_output(async_llm):
    async def run():
        async for _ in async_llm.generate([1] * 9000, SamplingParams(), "too-long"):
            pass

    with pytest.raises(ValueError, match="9000"):
        asyncio.run(run())


def test_leaving_early_aborts_and_frees_blocks(async_llm):
    bm = async_llm.engine.block_manager

    async def run():
        async for out in async_llm.generate("Tell me a long story", SamplingParams(max_tokens=500, ignore_eos=True),
                                            "leaver"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(100):  # the abort reaches the engine thread asynchronously
            if not async_llm.engine.has_unfinished():
                return
            await asyncio.sleep(0.02)

    asyncio.run(run())
    assert not async_llm.engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
