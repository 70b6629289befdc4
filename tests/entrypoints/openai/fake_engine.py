"""A stand-in for `AsyncLLM` in in-process server tests, for what a real engine cannot be made to do on cue:
each request's outputs come from a script (an async generator of RequestOutputs), which may raise or wait
for the test (`FakeEngine.release`). `build_app` makes a server over it; `serve_in_thread` puts that on a
real socket."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import uvicorn

from heron.engine.async_llm import EngineDeadError, RequestAbortedError
from heron.engine.messages import ServingInfo
from heron.entrypoints.cli import build_parser
from heron.entrypoints.openai import api_server
from heron.entrypoints.openai.server_config import serve_engine_config
from heron.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heron.stats import EngineStats
from tests.entrypoints.openai.remote_server import free_port

Script = Callable[["FakeEngine", str], AsyncIterator[RequestOutput]]


def output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    now = time.time()
    c = CompletionOutput(0, text, [3] * len(text), None, None, "length" if finished else None)
    return RequestOutput(request_id, None, [1, 2], None, [c], finished, RequestMetrics(now, now, now, now, now))


class FakeStream:
    def __init__(self, outputs: AsyncIterator[RequestOutput]) -> None:
        self._outputs = outputs
        self.aborted: asyncio.Future = asyncio.get_running_loop().create_future()

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        nxt = asyncio.ensure_future(anext(self._outputs))
        await asyncio.wait({nxt, self.aborted}, return_when=asyncio.FIRST_COMPLETED)
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        raise self.aborted.exception()

    def close(self) -> None:
        if not self.aborted.done():
            self.aborted.set_exception(RequestAbortedError("closed"))
            self.aborted.exception()  # retrieved: no warning when nobody reads it

    async def aclose(self) -> None:
        self.close()


class FakeEngine:
    def __init__(self, script: Script, tokenizer=None) -> None:
        self.script = script
        self.info = ServingInfo("fake", 64, tokenizer, {}, vocab_size=100, max_num_seqs=8)
        self.model_name, self.max_model_len, self.tokenizer = "fake", 64, tokenizer
        self.generation_defaults: dict = {}
        self.dead: BaseException | None = None
        self.added: list[str] = []  # request ids, in the order they reached the engine
        self.streams: list[FakeStream] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._released: asyncio.Event | None = None
        self._death_callbacks: list = []

    @property
    def released(self) -> asyncio.Event:
        """What `waits_for_release` scripts wait on (made on the server's loop)."""
        if self._released is None:
            self._released = asyncio.Event()
        return self._released

    def release(self) -> None:
        """From the test's thread: let the waiting scripts go on."""
        self.loop.call_soon_threadsafe(self.released.set)

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def on_dead(self, callback) -> None:
        self._death_callbacks.append(callback)

    def die(self, error: BaseException) -> EngineDeadError:
        """As AsyncLLM does: `dead` is set and the listeners hear of it; returns what its streams raise."""
        self.dead = error
        for callback in self._death_callbacks:
            callback(error)
        return EngineDeadError(f"the engine has stopped: {error!r}")

    async def add_request(
        self, prompt, params, request_id, priority=0, add_special_tokens=True, lora_request=None, user=None
    ) -> FakeStream:
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead!r}")
        self.loop = asyncio.get_running_loop()
        self.added.append(request_id)
        stream = FakeStream(self.script(self, request_id))
        self.streams.append(stream)
        return stream

    async def generate(self, prompt, params, request_id, priority=0, add_special_tokens=True):
        stream = await self.add_request(prompt, params, request_id, priority, add_special_tokens)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_lora(self, lora_request) -> None:
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: the stand-in engine reads no adapters.")

    def abort_all(self, message: str) -> None:
        for stream in self.streams:
            if not stream.aborted.done():
                stream.aborted.set_exception(RequestAbortedError(message))

    def shutdown(self) -> None:
        pass


async def waits_for_release(engine: FakeEngine, request_id: str):
    await engine.released.wait()
    yield output(request_id, "Hi", finished=True)


def build_app(monkeypatch, script: Script, *flags: str, tokenizer=None):
    """A server app over a FakeEngine (app.state.server.engine once loaded); `exits` collects the exit codes
    it asks for."""
    engine = FakeEngine(script, tokenizer)
    monkeypatch.setattr(api_server.AsyncLLM, "from_config", classmethod(lambda cls, config, cpu_threads=None: engine))
    args = build_parser().parse_args(["serve", "--served-model-name", "fake", "--device", "cpu", *flags])
    app = api_server.build_app(args, serve_engine_config(args))
    exits: list[int] = []
    app.state.server.stop = exits.append
    return app, exits


@contextlib.contextmanager
def serve_in_thread(
    app, server_class=uvicorn.Server, config: uvicorn.Config | None = None, verify=True
) -> Iterator[tuple[str, uvicorn.Server]]:
    """The app on a real socket (uvicorn in a thread), for what TestClient cannot show: connections,
    concurrency, headers before the body. `config`: uvicorn's settings (default: a free port, quiet); `verify`:
    how httpx checks an HTTPS server's certificate. Yields its URL once /health answers 200."""
    config = config or uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = server_class(config, app.state.server) if server_class is not uvicorn.Server else server_class(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"{'https' if config.is_ssl else 'http'}://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", verify=verify).status_code == 200:
                break
        time.sleep(0.05)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(30)
