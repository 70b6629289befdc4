"""/v1/chat/completions through the official openai SDK, sync and async."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest

from tests.entrypoints.openai.remote_server import MODEL, parallel

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def _texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


def test_plain_and_streamed_agree_for_greedy(client):
    create = partial(client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    plain, chunks, parts = parallel(
        lambda: create(),
        lambda: list(create(stream=True, stream_options={"include_usage": True})),
        # content as a list of text parts means the same as the joined string
        lambda: create(
            messages=[MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
        ),
    )
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-") and plain.model == MODEL
    [choice] = plain.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert plain.usage.completion_tokens == 5 and plain.usage.total_tokens == plain.usage.prompt_tokens + 5

    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.delta.role is None for c in chunks[1:] for ch in c.choices)
    assert _texts(chunks) == {0: choice.message.content}
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert parts.choices[0].message.content == choice.message.content


def test_max_completion_tokens_and_stop(client):
    create = partial(
        client.chat.completions.create,
        model=MODEL,
        temperature=0,
        messages=[{"role": "user", "content": "Count from 1 to 9, separated by commas."}],
    )
    full, capped, stopped = parallel(
        lambda: create(max_completion_tokens=8),
        lambda: create(max_completion_tokens=2),
        lambda: create(max_completion_tokens=8, stop=["3"]),
    )
    assert capped.usage.completion_tokens == 2
    text = full.choices[0].message.content
    assert "3" in text
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == text[: text.index("3")]


def test_n_seed_and_logprobs(client):
    kw = dict(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=1.0, seed=11, logprobs=True, top_logprobs=2
    )
    a, b, chunks = parallel(
        lambda: client.chat.completions.create(**kw),
        lambda: client.chat.completions.create(**kw),
        lambda: list(client.chat.completions.create(stream=True, **kw)),
    )
    texts = {c.index: c.message.content for c in a.choices}
    assert sorted(texts) == [0, 1]
    assert texts == {c.index: c.message.content for c in b.choices} == _texts(chunks)
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role) == [0, 1]
    for c in a.choices:
        content = c.logprobs.content
        assert len(content) == 4 and "".join(t.token for t in content) == c.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2 and bytes(t.bytes).decode() == t.token
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert len(streamed) == 8


def test_async_client(server):
    async def run():
        async with server.async_client() as aclient:
            kw = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
            plain, stream = await asyncio.gather(
                aclient.chat.completions.create(**kw), aclient.chat.completions.create(stream=True, **kw)
            )
            return plain.choices[0].message.content, "".join([c.choices[0].delta.content or "" async for c in stream])

    plain, streamed = asyncio.run(run())
    assert plain == streamed
