"""When the engine dies: a stream in flight ends with an error event and [DONE], a request waiting for
its answer gets 503, /health turns 503, and so do later requests. In-process (Starlette's TestClient) over a
stand-in engine that dies on cue, since a real one cannot be made to fail on demand."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from heron.engine.async_llm import EngineDeadError
from heron.engine.llm_engine import EngineStats
from heron.entrypoints.cli import build_parser
from heron.entrypoints.openai import api_server
from heron.entrypoints.openai.cli import serve_engine_config
from heron.outputs import CompletionOutput, RequestMetrics, RequestOutput


class DyingEngine:
    """Yields one token, then dies as AsyncLLM does: `dead` is set and the stream raises EngineDeadError."""

    model_name = "dying"
    max_model_len = 64
    tokenizer = None
    generation_defaults: dict = {}

    def __init__(self) -> None:
        self.dead: BaseException | None = None

    def get_stats(self) -> EngineStats:
        return EngineStats()

    async def generate(self, prompt, params, request_id, priority=0, add_special_tokens=True):
        now = time.time()
        yield RequestOutput(
            request_id,
            None,
            [1, 2],
            None,
            [CompletionOutput(0, "Hi", [3], None, None)],
            False,
            RequestMetrics(now, now, now, now),
        )
        self.dead = RuntimeError("CUDA error: an illegal memory access")
        raise EngineDeadError(f"the engine has stopped: {self.dead!r}")

    def shutdown(self) -> None:
        pass


@pytest.fixture
def http(monkeypatch):
    monkeypatch.setattr(api_server.AsyncLLM, "from_config", classmethod(lambda cls, config: DyingEngine()))
    args = build_parser().parse_args(["serve", "--served-model-name", "dying"])
    with TestClient(api_server.build_app(args, serve_engine_config(args))) as client:
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield client


def test_engine_death_mid_stream(http):
    assert http.get("/health").status_code == 200
    with http.stream("POST", "/v1/completions", json={"prompt": [1, 2], "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert json.loads(events[0])["choices"][0]["text"] == "Hi"
    assert json.loads(events[1])["error"]["code"] == "engine_dead"
    assert events[-1] == "[DONE]"
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"prompt": "again"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_engine_death_before_the_answer(http):
    r = http.post("/v1/completions", json={"prompt": [1, 2]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert http.get("/health").status_code == 503
