"""The asyncio front and the engine process behind it: streaming, errors before the first output,
cancellation frees the request, the engine process's death fails requests instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from heron.config import CacheConfig, EngineConfig
from heron.engine import async_llm as async_llm_module
from heron.engine.async_llm import TOKENIZE_INLINE_CHARS, AsyncLLM, EngineDeadError
from heron.sampling_params import SamplingParams
from tests.engine.scripted_engine_core import DIE, HANG, LATE_ACK, NO_ACK, REJECT, STREAM, TOKEN, run_scripted_core

pytestmark = pytest.mark.slow


def _start() -> AsyncLLM:
    return AsyncLLM.from_config(EngineConfig(cache=CacheConfig(kv_cache_memory=512 << 20)))


@pytest.fixture(scope="module")
def async_llm():
    engine = _start()
    yield engine
    engine.shutdown()


def test_streams_cumulative_outputs_to_the_same_result(async_llm, embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    offline = embedded_llm.generate("The weather today", params, use_tqdm=False)[0].outputs[0]

    async def run():
        outs = []
        async for out in async_llm.generate("The weather today", params, "s1"):
            c = out.outputs[0]
            outs.append((out.finished, c.text, list(c.token_ids), len(c.logprobs)))
        return outs, out

    outs, last = asyncio.run(run())
    assert outs[-1][0] and not any(o[0] for o in outs[:-1])
    assert all(b[1].startswith(a[1]) and b[2][: len(a[2])] == a[2] for a, b in zip(outs, outs[1:]))
    assert all(n == len(ids) for _, _, ids, n in outs)  # one logprobs entry per token at every point
    c = last.outputs[0]
    assert c.token_ids == offline.token_ids and c.text == offline.text
    assert c.cumulative_logprob == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    assert last.prompt_token_ids and last.metrics.first_token_time <= last.metrics.finished_time


def test_invalid_request_raises_before_any_output(async_llm):
    async def run():
        async for _ in async_llm.generate([1] * 9000, SamplingParams(), "too-long"):
            pass

    with pytest.raises(ValueError, match="9000"):
        asyncio.run(run())


class RecordingTokenizer:
    """Marks the ids it makes (token 1 first where special tokens are asked for, which this tokenizer never
    adds itself) and records on which thread it ran."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((add_special_tokens, threading.get_ident()))
        return [1] * add_special_tokens + self.tok.encode(text, add_special_tokens=False)


def test_text_prompts_are_tokenized_in_the_api_process(async_llm, monkeypatch):
    tok = RecordingTokenizer(async_llm.tokenizer)
    monkeypatch.setattr(async_llm, "tokenizer", tok)
    ids = tok.tok.encode("Hello there", add_special_tokens=False)

    async def run(prompt, rid, add_special):
        async for out in async_llm.generate(prompt, SamplingParams(max_tokens=2), rid, add_special_tokens=add_special):  # noqa: B007 (the last one is returned)
            pass
        return out, threading.get_ident()

    (chat, loop_thread), (plain, _) = (asyncio.run(run("Hello there", f"tok-{a}", a)) for a in (False, True))
    assert chat.prompt_token_ids == ids and plain.prompt_token_ids == [1] + ids
    assert chat.prompt == plain.prompt == "Hello there"
    assert tok.calls == [(False, loop_thread), (True, loop_thread)]  # short prompts: on the event loop

    long_prompt = "hello " * async_llm.max_model_len  # too many tokens for the model
    n = len(tok.tok.encode(long_prompt, add_special_tokens=False))
    assert len(long_prompt) > TOKENIZE_INLINE_CHARS and n >= async_llm.max_model_len
    with pytest.raises(ValueError, match=f"is {n} tokens long"):  # validated by the engine
        asyncio.run(run(long_prompt, "tok-long", False))
    assert tok.calls[-1][1] != loop_thread  # a long prompt is tokenized in a thread


def test_leaving_early_aborts_and_frees_blocks(async_llm):
    async def run():
        async for out in async_llm.generate(
            "Tell me a long story", SamplingParams(max_tokens=500, ignore_eos=True), "leaver"
        ):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(200):  # the abort and the stats after it cross the pipes asynchronously
            s = async_llm.get_stats()
            if s.finished.get("abort"):
                return s
            await asyncio.sleep(0.02)
        return async_llm.get_stats()

    s = asyncio.run(run())
    assert s.num_running == 0 and s.kv_cache_usage == 0 and s.finished.get("abort") == 1


def test_a_dead_engine_process_fails_requests_instead_of_hanging():
    engine = _start()
    try:

        async def run():
            gen = engine.generate("Count to a thousand:", SamplingParams(max_tokens=2000, ignore_eos=True), "d")
            await gen.__anext__()
            os.kill(engine._proc.pid, signal.SIGKILL)
            async for _ in gen:
                pass

        with pytest.raises(EngineDeadError, match="exited"):
            asyncio.run(asyncio.wait_for(run(), 60))
        assert engine.dead is not None

        async def later():
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2), "after"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(later())
    finally:
        engine.shutdown()


# -- the engine's acknowledgement, scripted (tests/engine/scripted_engine_core.py) ----------------------------


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(async_llm_module, "run_engine_core", run_scripted_core)
    engine = AsyncLLM.from_config(EngineConfig())
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncLLM, prompt: list[int], request_id: str) -> list:
    return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=5), request_id)]


async def _give_up(engine: AsyncLLM, prompt: list[int], request_id: str) -> None:
    """A client that times out while its request still waits for the engine's acknowledgement."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_collect(engine, prompt, request_id), 0.3)


def test_clients_that_give_up_before_the_acknowledgement_leave_the_engine_alive(scripted):
    async def run():
        await _give_up(scripted, [LATE_ACK], "gave-up-1")
        await _give_up(scripted, [LATE_ACK], "gave-up-2")
        scripted.abort("never-seen")  # an id the engine does not know
        # Both late acknowledgements are in the pipe ahead of this request's.
        return await asyncio.wait_for(_collect(scripted, [STREAM, 3], "after"), 30)

    outs = asyncio.run(run())
    assert scripted.dead is None
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [TOKEN] * 3


def test_a_rejected_prompt_beside_a_cancelled_one_leaves_the_engine_alive(scripted):
    async def run():
        # As the server does with a list of prompts: the first failure cancels the others.
        sibling = asyncio.ensure_future(_collect(scripted, [LATE_ACK], "sibling"))
        bad = asyncio.ensure_future(_collect(scripted, [REJECT], "bad"))
        await asyncio.wait([sibling, bad], return_when=asyncio.FIRST_EXCEPTION)
        sibling.cancel()
        await asyncio.gather(sibling, return_exceptions=True)
        with pytest.raises(ValueError, match="max_tokens"):
            bad.result()
        return await asyncio.wait_for(_collect(scripted, [STREAM, 2], "after"), 30)

    outs = asyncio.run(run())
    assert scripted.dead is None and outs[-1].outputs[0].token_ids == [TOKEN] * 2


def test_engine_death_after_cancelled_waiters_fails_every_request(scripted):
    async def run():
        await _give_up(scripted, [NO_ACK], "gave-up-1")
        await _give_up(scripted, [NO_ACK], "gave-up-2")
        in_flight = scripted.generate([HANG], SamplingParams(), "in-flight")
        await anext(in_flight)
        dying = asyncio.ensure_future(_collect(scripted, [DIE], "die"))
        with pytest.raises(EngineDeadError, match="scripted engine failure"):
            await asyncio.wait_for(anext(in_flight), 10)  # a hang would time out instead
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(dying, 10)
        with pytest.raises(EngineDeadError):
            await _collect(scripted, [STREAM, 1], "later")

    asyncio.run(run())
    assert scripted.dead is not None
