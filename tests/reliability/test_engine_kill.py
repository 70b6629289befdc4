"""The engine process killed under load: every client hears of it within a second (a stream as an error
event and [DONE], a plain request as a 503), and `heron serve` exits 1, for its supervisor to restart it."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer

pytestmark = pytest.mark.slow

LONG = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True}


def test_killing_the_engine_fails_every_request_at_once_and_exits_1():
    server = RemoteServer()
    try:
        pid = int(re.search(r"Engine process started \(pid (\d+)\)", server.output()).group(1))
        url = f"{server.url}/v1/completions"
        started = threading.Barrier(5)
        killed_at: list[float] = []
        heard: list[tuple[float, str]] = []

        def stream() -> None:
            with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
                lines = (line.removeprefix("data: ") for line in r.iter_lines() if line)
                next(lines)  # generating
                started.wait()
                events = list(lines)
            heard.append((time.monotonic(), json.loads(events[-2])["error"]["code"] if events[-1] == "[DONE]" else ""))

        def plain() -> None:
            started.wait()
            r = httpx.post(url, json=LONG, timeout=60)
            heard.append((time.monotonic(), r.json()["error"]["code"] if r.status_code == 503 else r.text))

        clients = [threading.Thread(target=stream) for _ in range(3)] + [threading.Thread(target=plain)]
        for c in clients:
            c.start()
        started.wait()
        time.sleep(0.5)  # the plain request is in the engine too
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)
        for c in clients:
            c.join(30)
        assert [code for _, code in heard] == ["engine_dead"] * 4
        assert max(t for t, _ in heard) - killed_at[0] < 1.0
        assert server.proc.wait(timeout=60) == 1
        assert "exiting with code 1" in server.output()
    finally:
        server.stop()
