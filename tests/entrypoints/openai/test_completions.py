"""/v1/models and /v1/completions through the official openai SDK, sync and async. Requests that do not
depend on each other run at once (`parallel`), which keeps the suite fast on a CPU."""

from __future__ import annotations

import asyncio
from functools import partial

import httpx
import pytest

from tests.entrypoints.openai.remote_server import ALIAS, API_KEY, MAX_MODEL_LEN, MODEL, parallel

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    assert all(m.object == "model" and m.owned_by == "heron" and m.created > 0 for m in models)
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_plain_and_streamed_agree_for_greedy(client):
    create = partial(client.completions.create, prompt=PROMPT, max_tokens=6, temperature=0)
    plain, chunks, alias = parallel(
        lambda: create(model=MODEL), lambda: list(create(model=MODEL, stream=True)), lambda: create(model=ALIAS)
    )
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-") and plain.model == MODEL
    [choice] = plain.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert plain.usage.completion_tokens == 6
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 6

    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # An alias names the same model; the response reports the name asked for.
    assert alias.model == ALIAS and alias.choices[0].text == choice.text


def test_stream_include_usage(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_several_prompts(client):
    create = partial(client.completions.create, model=MODEL, max_tokens=2, temperature=0)
    ids, texts, one = parallel(
        lambda: create(prompt=[[504, 3458, 282], [504, 3458]], n=2),
        lambda: create(prompt=[PROMPT, "Hello"]),
        lambda: create(prompt="Hello"),
    )
    assert sorted(c.index for c in ids.choices) == [0, 1, 2, 3]
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 8
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[1].text == one.choices[0].text


def test_seeded_samples_reproduce_plain_and_streamed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", n=3, max_tokens=4, temperature=1.0, seed=7)

    def streamed() -> dict[int, str]:
        texts: dict[int, str] = {}
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        return texts

    a, b, s = parallel(lambda: client.completions.create(**kw), lambda: client.completions.create(**kw), streamed)
    texts = {c.index: c.text for c in a.choices}
    assert texts == {c.index: c.text for c in b.choices} == s
    assert len(set(texts.values())) > 1  # the n samples differ: sampling is on, and the seed fixes it


def test_samples_that_stop_early_finish_once(client):
    kw = dict(
        model=MODEL, prompt="Once upon a time", n=4, max_tokens=8, temperature=1.0, seed=3, stop=["e"], logprobs=0
    )
    plain, chunks = parallel(
        lambda: client.completions.create(**kw), lambda: list(client.completions.create(stream=True, **kw))
    )
    finishes = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in plain.choices}
    assert len({len(c.logprobs.tokens) for c in plain.choices}) > 1  # they did finish at different steps


def test_logprobs_and_echo(client):
    create = partial(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    out, echo = parallel(lambda: create(logprobs=3), lambda: create(logprobs=1, echo=True))
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        assert top[tok] == val == max(top.values())  # greedy: the sampled token is the likeliest

    text, lp = echo.choices[0].text, echo.choices[0].logprobs
    assert text == PROMPT + out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert len(lp.tokens) == echo.usage.prompt_tokens + 3 and "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_stop(client):
    create = partial(client.completions.create, model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    full, stopped, streamed = parallel(
        lambda: create(), lambda: create(stop=[" 6", "xyz"]), lambda: list(create(stop=" 6", stream=True))
    )
    full, stopped = full.choices[0], stopped.choices[0]
    assert " 6" in full.text
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(" 6")]
    assert "".join(c.choices[0].text for c in streamed) == stopped.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_extras_pass_through(client):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"11": -100},
        user="u1",
        extra_body=dict(
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
            min_tokens=4,
            ignore_eos=True,
            stop_token_ids=[2],
            skip_special_tokens=False,
        ),
    )
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def test_allowed_token_ids_are_the_only_tokens_drawn(server, client):
    allowed = [17, 28, 905]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    pieces = {
        httpx.post(f"{server.url}/detokenize", json={"tokens": [t]}, headers=auth).json()["prompt"] for t in allowed
    }
    assert len(pieces) == 3
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 6 and set(tokens) <= pieces


def test_async_client(server):
    async def run():
        async with server.async_client() as aclient:
            plain, stream, models = await asyncio.gather(
                aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0),
                aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True),
                aclient.models.list(),
            )
            streamed = "".join([c.choices[0].text async for c in stream])
            return plain.choices[0].text, streamed, [m.id for m in models.data]

    plain, streamed, models = asyncio.run(run())
    assert plain == streamed and models == [MODEL, ALIAS]
