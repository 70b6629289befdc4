"""200 concurrent streams against one fresh `heron serve`, whose clients time out or hang up at random
moments (while their request waits for the engine, mid-stream, or never): every request either completes
exactly (the same text as alone) or is aborted, each is finished once in the engine, the KV cache empties,
and the server stays healthy. The server picks its own torch threads (no OMP_NUM_THREADS): with torch's
default of one per core, such a burst once completed 1 stream in 200."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer

pytestmark = pytest.mark.slow

NUM_STREAMS = 200
MAX_TOKENS = 12
PROMPTS = ["The sky is", "My favourite food is", "Python is a", "In 1990,"]
REASONS = ("stop", "length", "abort")


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--kv-cache-memory-bytes", str(1 << 30), env={"OMP_NUM_THREADS": None})
    yield srv
    srv.stop()


def _body(endpoint: str, prompt: str) -> dict:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    if endpoint == "/v1/completions":
        return {**body, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}


def _text(event: dict) -> str:
    choice = event["choices"][0]
    return choice.get("text") or choice.get("delta", {}).get("content") or ""


async def _stream(http: httpx.AsyncClient, endpoint: str, prompt: str, behaviour: str, rng: random.Random):
    """('complete', text, finish_reason) or ('gave up', None, None)."""
    timeout = httpx.Timeout(120, read=rng.uniform(0.05, 3.0)) if behaviour == "timeout" else 120
    hang_up_after = rng.randint(0, 4) if behaviour == "disconnect" else None
    text, finish, events = "", None, 0
    try:
        async with http.stream("POST", endpoint, json=_body(endpoint, prompt), timeout=timeout) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return "complete", text, finish
                if hang_up_after is not None and events >= hang_up_after:
                    return "gave up", None, None  # leaving the block closes the connection
                event = json.loads(data)
                assert "error" not in event, event
                events += 1
                text += _text(event)
                finish = event["choices"][0]["finish_reason"] or finish
    except httpx.TimeoutException:
        return "gave up", None, None
    raise AssertionError("the stream ended without [DONE]")


def _finished(server) -> dict[str, float]:
    m = server.metrics()
    return {r: m.get(f"heron:request_success_total{{finished_reason={r}}}", 0.0) for r in REASONS}


def test_200_streams_with_random_timeouts_and_disconnects(server):
    rng = random.Random(18)
    calls = [(endpoint, prompt) for endpoint in ("/v1/completions", "/v1/chat/completions") for prompt in PROMPTS]

    async def run():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as http:
            alone = {c: (await _stream(http, *c, "complete", rng))[1:] for c in calls}
            before = _finished(server)
            plan = [
                (calls[i % len(calls)], rng.choice(["complete", "complete", "timeout", "disconnect"]))
                for i in range(NUM_STREAMS)
            ]
            results = await asyncio.gather(*(_stream(http, *c, b, random.Random(i)) for i, (c, b) in enumerate(plan)))
            return alone, before, plan, results

    alone, before, plan, results = asyncio.run(run())
    completed = 0
    for ((endpoint, prompt), _), (outcome, text, finish) in zip(plan, results):
        if outcome == "complete":
            completed += 1
            assert (text, finish) == alone[(endpoint, prompt)], (endpoint, prompt)
    gave_up = NUM_STREAMS - completed
    assert completed >= NUM_STREAMS // 3 and gave_up >= NUM_STREAMS // 5  # both kinds happened

    # Each request finished exactly once in the engine: completed, or aborted when its client left (a client
    # that left just as its last token came may have completed there).
    deadline = time.monotonic() + 60
    while True:
        after = _finished(server)
        delta = {r: after[r] - before[r] for r in REASONS}
        m = server.metrics()
        idle = m["heron:num_requests_running"] == m["heron:num_requests_waiting"] == 0
        if (sum(delta.values()) == NUM_STREAMS and idle and m["heron:kv_cache_usage_perc"] == 0) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert sum(delta.values()) == NUM_STREAMS, delta
    assert delta["abort"] <= gave_up and delta["stop"] + delta["length"] >= completed, (delta, completed)
    assert idle and m["heron:kv_cache_usage_perc"] == 0, m

    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "CPU thread(s) (the default" in server.output()
