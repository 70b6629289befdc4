"""Failures a real engine cannot be made to have on cue, in-process over a stand-in engine (fake_engine.py):
the engine's death (mid-stream, before the answer, and the server's exit), an internal error (a 500 that
keeps the connection and logs one traceback), and streams cut at --shutdown-timeout."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
from fastapi.testclient import TestClient

from heron.entrypoints.openai import api_server
from tests.entrypoints.openai.fake_engine import FakeEngine, build_app, output, serve_in_thread


async def dies_after_one_token(engine: FakeEngine, request_id: str):
    yield output(request_id, "Hi")
    raise engine.die(RuntimeError("CUDA error: an illegal memory access"))


async def dies_at_once(engine: FakeEngine, request_id: str):
    raise engine.die(RuntimeError("CUDA error: an illegal memory access"))
    yield  # an async generator


async def fails(engine: FakeEngine, request_id: str):
    raise RuntimeError("a bug")
    yield


async def hangs(engine: FakeEngine, request_id: str):
    yield output(request_id, "Hi")
    await asyncio.Event().wait()


def _ready(http: TestClient) -> TestClient:
    deadline = time.monotonic() + 10
    while http.get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    return http


def test_engine_death_mid_stream_ends_the_stream_and_the_server(monkeypatch):
    app, exits = build_app(monkeypatch, dies_after_one_token)
    with TestClient(app) as http:
        _ready(http)
        with http.stream("POST", "/v1/completions", json={"prompt": [1, 2], "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert json.loads(events[0])["choices"][0]["text"] == "Hi"
        err = json.loads(events[1])["error"]
        assert err["code"] == "engine_dead" and "supervisor restarts it" in err["message"]
        assert events[-1] == "[DONE]"
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "again"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert exits == [1]  # the server exits non-zero, for its supervisor to restart it


def test_engine_death_before_the_answer(monkeypatch):
    app, exits = build_app(monkeypatch, dies_at_once)
    with TestClient(app) as http:
        _ready(http)
        r = http.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
    assert exits == [1]


def _raw_requests(port: int, requests: list[str], body: str = '{"prompt": [1, 2]}') -> list[str]:
    """Send the requests one after another on one connection; the status line and body of each answer."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reader = sock.makefile("rb")
        for line in requests:
            payload = body if line.startswith("POST") else ""
            sock.sendall(
                f"{line} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\n\r\n{payload}".encode()
            )
            status = reader.readline().decode()
            headers = {}
            while (h := reader.readline().decode().strip()) != "":
                k, _, v = h.partition(":")
                headers[k.lower()] = v.strip()
            answers.append(status + reader.read(int(headers.get("content-length", 0))).decode())
    return answers


def test_an_internal_error_is_a_500_that_keeps_the_connection_and_logs_one_traceback(monkeypatch, caplog):
    app, _ = build_app(monkeypatch, fails)
    with serve_in_thread(app) as (url, _):
        engine = app.state.server.engine
        monkeypatch.setattr(engine, "get_stats", lambda: 1 / 0)  # /metrics fails outside any route's handling
        with caplog.at_level(logging.ERROR):
            requests = ["POST /v1/completions"] * 3 + ["GET /metrics"] * 2 + ["GET /health"]
            answers = _raw_requests(int(url.rsplit(":", 1)[1]), requests)
    for a in answers[:5]:  # every one answered on the same connection: none closed it
        assert a.startswith("HTTP/1.1 500"), a
        body = json.loads(a.split("\r\n")[-1] if "\r\n" in a else a[a.index("{") :])
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
    assert answers[5].startswith("HTTP/1.1 200")
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 2  # once per failing place, not per request
    assert sum("Internal server error" in r.getMessage() for r in caplog.records) == 5


def test_streams_cut_at_the_shutdown_timeout_end_with_an_error_event(monkeypatch):
    app, _ = build_app(monkeypatch, hangs, "--shutdown-timeout", "0.5")
    with serve_in_thread(app, api_server._Server) as (url, server):
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [1], "stream": True}, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            events = [next(lines)]
            server.should_exit = True  # as SIGTERM does
            started = time.monotonic()
            events += list(lines)
            took = time.monotonic() - started
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hi"
    err = json.loads(events[1].removeprefix("data: "))["error"]
    assert err["code"] == "server_shutting_down" and "--shutdown-timeout" in err["message"]
    assert events[-1] == "data: [DONE]" and len(events) == 3
    assert 0.4 < took < 5
