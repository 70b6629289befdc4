"""An asyncio front for the engine, for the server. The engine runs in its own process
(heron/engine/engine_core.py), so the event loop (HTTP, JSON, streaming) and the engine's host work run
on two cores instead of taking turns on one GIL; the event loop never waits on the GPU, and the GPU never
waits on HTTP.

Two threads of this process talk to the engine process: a writer (requests and aborts, so the event loop
never blocks on a full pipe) and a reader (each step's new tokens). The reader hands a step's outputs to
the event loop in one call; there each request's deltas are folded into its state and its asyncio queue is
signalled; the request's reader then takes one cumulative snapshot however many steps arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from heron.config import EngineConfig
from heron.engine.engine_core import OutputAccumulator, run_engine_core
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams
from heron.stats import EngineStats

logger = logging.getLogger(__name__)

# Text prompts up to this many characters are tokenized on the event loop (~1 ms for 3,500 characters of
# the word-level benchmark tokenizer); longer ones in a thread. Encoding holds the GIL (two threads encode
# no faster than one), so a thread frees no CPU: it only lets the loop run between GIL switches. Inline, a
# burst's first request reaches the engine within a few ms instead of tens (thread hand-offs fighting over
# the GIL); a 30k-word prompt would stall every stream for ~90 ms inline, ~3 ms from a thread.
TOKENIZE_INLINE_CHARS = 20_000


class EngineDeadError(RuntimeError):
    """The engine failed or its process exited; every request in flight gets this, and every later one."""


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        """Start the engine process and wait until its model is loaded; a failure to load raises here."""
        ctx = multiprocessing.get_context("spawn")
        commands_child, self._commands = ctx.Pipe(duplex=False)  # (read end, write end)
        self._events, events_child = ctx.Pipe(duplex=False)
        _widen(self._events)
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # Not a daemon: the engine process may start tensor-parallel workers of its own.
        self._proc = ctx.Process(
            target=run_engine_core, args=(config, commands_child, events_child), name="heron-engine"
        )
        self._proc.start()
        commands_child.close()
        events_child.close()
        atexit.register(self.shutdown)
        try:
            kind, info = self._events.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})") from None
        if kind == "dead":
            self._proc.join(30)
            raise RuntimeError(f"the engine could not start: {info}")
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self.tokenizer = info.tokenizer
        self.generation_defaults: dict = info.generation_defaults
        self.dead: BaseException | None = None
        self._stats = EngineStats()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, OutputAccumulator]] = {}
        self._added: dict[str, Future] = {}
        self._writer = threading.Thread(target=self._write, name="heron-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="heron-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(config)

    def get_stats(self) -> EngineStats:
        """The engine's snapshot after its latest step."""
        return self._stats

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Invalid requests raise ValueError before
        the first output; leaving the iteration early (or being cancelled) aborts the request."""
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = None if text is None else await self._tokenize(text, add_special_tokens)
        if self.dead is not None:  # checked after the await, right before the request is registered
            raise EngineDeadError(f"the engine has stopped: {self.dead!r}")
        stream: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        # The engine never sends the prompt back: its outputs take it from here.
        acc = OutputAccumulator(request_id, text, list(prompt) if text is None else prompt_ids)
        self._streams[request_id] = (asyncio.get_running_loop(), stream, acc)
        self._added[request_id] = added
        self._outbox.put(("add", request_id, prompt, prompt_ids, params, priority, add_special_tokens))
        try:
            await asyncio.wrap_future(added)  # raises the engine's ValueError, if any
            while True:
                signal = await stream.get()  # new output arrived (True), or the engine died (the error)
                while not stream.empty() and not isinstance(signal, BaseException):
                    signal = stream.get_nowait()
                if isinstance(signal, BaseException):
                    raise EngineDeadError(f"the engine has stopped: {signal!r}") from signal
                out = acc.snapshot()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.abort(request_id)  # a no-op for a request that already finished

    async def _tokenize(self, prompt: str, add_special_tokens: bool) -> list[int] | None:
        """A text prompt's ids, made here so that the engine process's steps never wait on tokenizing a
        burst of new requests. None without a tokenizer (the engine then rejects the prompt)."""
        if self.tokenizer is None:
            return None
        if len(prompt) <= TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special_tokens)

    def abort(self, request_id: str) -> None:
        self._outbox.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine process (it stops its tensor-parallel workers); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(("shutdown",))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._outbox.put(None)

    # -- the two threads -------------------------------------------------------------------------------------

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._commands.send(msg)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        try:
            while True:
                msg = self._events.recv()
                if msg[0] == "outputs":
                    self._stats = msg[2]
                    self._dispatch(msg[1])
                elif msg[0] == "added":
                    _, rid, error = msg
                    added = self._added.pop(rid, None)
                    if added is None:
                        continue
                    if error is None:
                        added.set_result(None)
                    else:
                        added.set_exception(_rebuild(*error))
                else:  # "dead"
                    raise RuntimeError(msg[1])
        except BaseException as e:  # noqa: BLE001 - everything waiting must hear of it
            if self._stopping:
                return
            if isinstance(e, EOFError | OSError):
                e = RuntimeError(f"the engine process exited (exit code {self._proc.exitcode})")
            logger.error("the engine has stopped: %s", e)
            self.dead = e
            for added in list(self._added.values()):
                added.set_exception(EngineDeadError(f"the engine has stopped: {e!r}"))
            self._added.clear()
            for loop, stream, _ in list(self._streams.values()):
                loop.call_soon_threadsafe(stream.put_nowait, e)

    def _dispatch(self, wires: list[tuple]) -> None:
        """Hand one step's outputs to their event loops, one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for wire in wires:
            target = self._streams.get(wire[0])
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], target[2], wire))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, OutputAccumulator, tuple]]) -> None:
    for stream, acc, wire in items:
        acc.add(wire)
        stream.put_nowait(True)


def _widen(conn, size: int = 1 << 20) -> None:
    """Let the engine run ahead of a busy event loop by some dozens of steps (a step's message is tens of
    kilobytes at a large batch) before a full pipe stops it; the default 64 KiB holds about two. Linux only;
    elsewhere the default stays."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
    except (ImportError, AttributeError, OSError):
        pass


def _rebuild(type_name: str, message: str) -> Exception:
    """The engine's rejection of a request, as the caller expects it (ValueError: a bad request)."""
    return ValueError(message) if type_name == "ValueError" else RuntimeError(f"{type_name}: {message}")
