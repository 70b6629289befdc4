"""An asyncio front for the engine, for the server: the engine steps in its own thread, so the event
loop (HTTP, streaming) never waits on the GPU and the GPU never waits on HTTP.

Requests and aborts cross into the engine thread through a queue; outputs come back to each request's
asyncio queue. Outputs are cumulative, so a slow reader skips straight to the newest one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from heron.config import EngineConfig
from heron.engine.llm_engine import EngineStats, LLMEngine
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request in flight gets this, and so does every later one."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="heron-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Invalid requests raise ValueError before
        the first output; leaving the iteration early (or being cancelled) aborts the request."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead!r}")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        self._streams[request_id] = (loop, stream)
        self._send(("add", request_id, prompt, params, priority, add_special_tokens, added))
        try:
            await asyncio.wrap_future(added)  # raises the engine's ValueError, if any
            while True:
                out = await stream.get()
                while not stream.empty():
                    out = stream.get_nowait()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine has stopped: {out!r}") from out
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self._send(("abort", request_id))  # a no-op for a request that already finished

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------------------------

    def _send(self, cmd: tuple) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - everything waiting must hear of it
            logger.exception("engine step failed; the engine is stopping")
            self.dead = e
            for rid in list(self._streams):
                self._deliver(rid, e)
            while not self._inbox.empty():
                cmd = self._inbox.get_nowait()
                if cmd[0] == "add":
                    cmd[-1].set_exception(EngineDeadError(f"the engine has stopped: {e!r}"))

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            cmd = self._inbox.get_nowait()
            if cmd[0] == "add":
                _, rid, prompt, params, priority, add_special, added = cmd
                if rid not in self._streams:  # the caller left before the engine saw the request
                    added.cancel()
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority, add_special_tokens=add_special)
                    added.set_result(None)
                except Exception as e:  # noqa: BLE001 - the caller gets it as the answer to its request
                    added.set_exception(e)
            else:
                self.engine.abort(cmd[1])

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
