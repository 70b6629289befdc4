"""How requests enter the engine, in-process over a stand-in engine whose requests wait for the test:
--max-waiting-requests holds under a burst across endpoints, a request of many prompts lets a later small
one in, a stream's headers go out before its first token."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from fastapi.testclient import TestClient

from heron.entrypoints.openai.serving_engine import WAITING_PER_REQUEST
from tests.entrypoints.openai.fake_engine import build_app, serve_in_thread, waits_for_release

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_max_waiting_requests_holds_under_a_burst_across_endpoints(monkeypatch, embedded_tokenizer):
    app, _ = build_app(monkeypatch, waits_for_release, "--max-waiting-requests", "8", tokenizer=embedded_tokenizer)
    with serve_in_thread(app) as (url, _):
        engine = app.state.server.engine

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                calls = [("/v1/completions", {"prompt": [1, 2]}), ("/v1/chat/completions", CHAT)] * 40
                tasks = [asyncio.ensure_future(http.post(path, json=body)) for path, body in calls]
                while sum(t.done() for t in tasks) < 72:  # the refused ones answer at once
                    await asyncio.sleep(0.01)
                refused = [t.result() for t in tasks if t.done()]
                admitted = len(engine.added)
                engine.release()
                return refused, admitted, await asyncio.gather(*tasks)

        refused, admitted, answers = asyncio.run(burst())
    assert admitted == 8
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
    assert sorted(r.status_code for r in answers) == [200] * 8 + [503] * 72
    assert app.state.server.admission.waiting == 0


def test_a_request_of_many_prompts_lets_a_later_small_one_in(monkeypatch):
    app, _ = build_app(monkeypatch, waits_for_release)
    with serve_in_thread(app) as (url, _):
        engine = app.state.server.engine

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                big = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [[1]] * 40}))
                while len(engine.added) < WAITING_PER_REQUEST:
                    await asyncio.sleep(0.01)
                small = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [7]}))
                while len(engine.added) < WAITING_PER_REQUEST + 1:
                    await asyncio.sleep(0.01)
                first_ones = list(engine.added)
                engine.release()
                return first_ones, await big, await small

        first_ones, big, small = asyncio.run(run())
    # The small request reached the engine right after the big one's first prompts, not after all 40.
    assert len({rid.rsplit("-", 1)[0] for rid in first_ones[:WAITING_PER_REQUEST]}) == 1
    assert first_ones[-1].rsplit("-", 1)[0] != first_ones[0].rsplit("-", 1)[0]
    assert big.status_code == 200 and [c["index"] for c in big.json()["choices"]] == list(range(40))
    assert small.status_code == 200 and len(engine.added) == 41


def test_a_stream_starts_before_its_first_token(monkeypatch):
    app, _ = build_app(monkeypatch, waits_for_release)
    with serve_in_thread(app) as (url, _):
        engine = app.state.server.engine
        body = {"prompt": [1], "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=5)) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert not engine.released.is_set()  # the headers came with no token yet
            engine.release()
            events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"text":"Hi"' in events[0]


def test_too_many_sequences_for_one_request_is_400(monkeypatch):
    app, _ = build_app(monkeypatch, waits_for_release, "--max-seqs-per-request", "6")
    with serve_in_thread(app) as (url, _):
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": [[1]] * 4, "n": 2})
        big_n = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "n": 7})
        engine = app.state.server.engine
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "--max-seqs-per-request" in too_many.json()["error"]["message"]
    assert big_n.status_code == 400 and big_n.json()["error"]["param"] == "n"
    assert engine.added == []


def test_a_client_gone_before_its_stream_starts_gives_everything_back(monkeypatch):
    """A stream whose first write fails (the client has left) never starts its generator (ASGI 2.4 servers):
    its requests must end, and its places in the waiting queue come back, all the same."""
    app, _ = build_app(monkeypatch, waits_for_release, "--max-waiting-requests", "4")
    body = json.dumps({"prompt": [[1], [2]], "stream": True}).encode()
    calls = 0

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client says nothing more...
        raise AssertionError

    async def send(message: dict) -> None:
        raise OSError("Connection reset by peer")  # ...and is gone when the answer starts

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    with TestClient(app) as http:
        _wait_until(lambda: http.get("/health").status_code == 200)
        http.portal.call(app, scope, receive, send)
        state = app.state.server
        assert len(state.engine.streams) == 2 and all(s.aborted.done() for s in state.engine.streams)
        assert state.admission.waiting == 0
