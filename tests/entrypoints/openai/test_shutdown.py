"""A server of our own, since these tests end it: /health while loading, the waiting-requests limit, and
a graceful SIGTERM that lets a stream finish and exits 0."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        "--max-num-seqs", "1", "--max-waiting-requests", "1", "--shutdown-timeout", "60", "--enable-log-requests"
    )
    yield srv
    srv.stop(signal.SIGKILL)


def test_health_is_503_while_loading(server):
    assert server.health_seen[-2:] == [503, 200]


def test_over_max_waiting_requests_is_503(server):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    with (
        httpx.Client(timeout=httpx.Timeout(30, read=None)) as http,
        http.stream("POST", url, json={**body, "stream": True}) as running,
    ):
        lines = running.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)  # the one sequence slot is taken
        waiter = threading.Thread(target=_wait_then_give_up, args=(url, body))
        waiter.start()
        deadline = time.monotonic() + 10
        while server.metrics()["heron:num_requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = http.post(url, json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and err["type"] == "server_error"
        waiter.join()
    deadline = time.monotonic() + 30
    while server.metrics()["heron:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    ok = httpx.post(url, json={**body, "prompt": "A logged prompt", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert "A logged prompt" in server.output()  # --enable-log-requests


def test_more_samples_than_seats_is_400(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def _wait_then_give_up(url: str, body: dict) -> None:
    """A request that waits for the busy sequence slot, until its client gives up."""
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(30, read=4))


def test_sigterm_lets_a_stream_finish_and_exits_0(server):
    body = {
        "model": MODEL,
        "prompt": "Tell me a story.",
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        events.append(next(lines))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections once stopping
            httpx.get(f"{server.url}/health")
        events += list(lines)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0


def test_sigterm_while_loading_exits_0():
    loading = RemoteServer(until=503)
    assert loading.stop(signal.SIGTERM, timeout=30) == 0
