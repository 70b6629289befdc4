"""An asyncio front for the engine, for the server. The engine runs in its own process
(heron/engine/engine_core.py), so the event loop (HTTP, JSON, streaming) and the engine's host work run
on two cores instead of taking turns on one GIL; the event loop never waits on the GPU, and the GPU never
waits on HTTP.

Two threads of this process talk to the engine process: a writer (requests and aborts, so the event loop
never blocks on a full pipe) and a reader (acknowledgements and each step's new tokens). The reader never
touches a request's state: it hands each message to the request's event loop (`call_soon_threadsafe`),
where its `RequestStream` takes it or, when the caller has gone meanwhile, ignores it. So a caller that
gives up at any moment (a client's timeout) costs an abort and nothing else, and the engine's death
reaches every caller still listening.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Protocol, TypeVar

from heron.config import EngineConfig
from heron.engine.detokenizer import LogprobTexts
from heron.engine.engine_core import run_engine_core
from heron.engine.messages import (
    AbortRequest,
    Added,
    AddLoRA,
    AddRequest,
    EngineDead,
    RemoveLoRA,
    RequestDelta,
    ServingInfo,
    Shutdown,
    StepOutputs,
)
from heron.engine.output_assembler import OutputAssembler
from heron.lora_request import LoRARequest
from heron.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from heron.pooling_params import PREFILL_ONLY, PoolingParams
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.stats import EngineStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Text up to this many characters is tokenized on the event loop (~1 ms for 3,500 characters of the
# word-level benchmark tokenizer); longer text on the tokenizer's own thread. Encoding holds the GIL (two
# threads encode no faster than one), so a thread frees no CPU: it only lets the loop run between GIL
# switches. Inline, a burst's first request reaches the engine within a few ms instead of tens (thread
# hand-offs fighting over the GIL); a 30k-word prompt would stall every stream for ~90 ms inline, ~3 ms
# from a thread. One thread, so that concurrent long prompts queue instead of each holding its encoding's
# memory at once.
TOKENIZE_INLINE_CHARS = 20_000


class EngineProcess(Protocol):
    """Where the engine runs, as AsyncLLM watches it: a local process (multiprocessing.Process), or a Ray actor
    (heron/engine/ray_replica.py)."""

    exitcode: int | str | None

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...

    def terminate(self) -> None: ...


# An engine started: where it runs, the commands' write end, the events' read end; `Ready` is the first event.
EngineLaunch = tuple[EngineProcess, Connection, Connection]


def spawn_engine_process(
    config: EngineConfig, cpu_threads: int | None, env: dict[str, str] | None = None
) -> EngineLaunch:
    """The engine in a local process over two pipes; `env` is set there before the model loads (a replica's
    CUDA_VISIBLE_DEVICES)."""
    ctx = multiprocessing.get_context("spawn")
    commands_child, commands = ctx.Pipe(duplex=False)  # (read end, write end)
    events, events_child = ctx.Pipe(duplex=False)
    _widen(events)
    # Not a daemon: the engine process may start tensor-parallel workers of its own.
    proc = ctx.Process(
        target=run_engine_core, args=(config, commands_child, events_child, cpu_threads, env), name="heron-engine"
    )
    proc.start()
    logger.info("Engine process started (pid %d)", proc.pid)
    commands_child.close()
    events_child.close()
    return proc, commands, events


class EngineDeadError(RuntimeError):
    """The engine failed or its process exited; every request in flight gets this, and every later one."""


class EngineStartError(RuntimeError):
    """The engine process could not load the model; it has logged its own traceback, so this says why in a line."""


class RequestAbortedError(RuntimeError):
    """The request was aborted for everyone (`AsyncLLM.abort_all`), e.g. by a server's shutdown deadline."""


class RequestStream:
    """One request as its caller sees it: the engine's acknowledgement, then its outputs, of the kind its
    SamplingParams ask for (output_assembler.py), one however many steps arrived since the previous one.
    Lives on one event loop; the reader thread only schedules its `_on_*` methods there, so nothing here
    races with the caller's cancellation. Closing it (or leaving `AsyncLLM.generate`) aborts the request
    unless it has ended."""

    def __init__(self, owner: AsyncLLM, request_id: str, outputs: OutputAssembler) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._owner = owner
        self._outputs = outputs
        self._wake = asyncio.Event()
        self._accepted = False
        self._error: BaseException | None = None
        self._ended = False  # the engine holds nothing of it any more: finished, rejected or aborted
        self._finished = False  # the last output was taken
        self._closed = False

    # -- events, scheduled on self.loop by the reader thread ---------------------------------------------

    def _on_added(self, error: Exception | None) -> None:
        if error is None:
            self._accepted = True
        else:
            self._ended = True
            self._fail(error)
        self._wake.set()

    def _on_output(self, delta: RequestDelta) -> None:
        self._outputs.add(delta)
        if delta.finished:  # the engine is done with it, and so is the reader thread
            self._ended = True
            self._owner._unregister(self)
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake.set()

    # -- the caller's side ----------------------------------------------------------------------------------

    async def accepted(self) -> None:
        """Return once the engine has queued the request; raise its rejection (ValueError naming the field)
        or EngineDeadError."""
        while not self._accepted:
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or self._finished:
            raise StopAsyncIteration
        while not self._outputs.ready():
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()
        out = self._outputs.take()
        self._finished = out.finished
        return out

    @property
    def embedding(self) -> list[float] | None:
        """A pooling request's vector, once it has finished."""
        return self._outputs.embedding

    def close(self) -> None:
        """Stop listening; the engine aborts the request if it is still there. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owner._unregister(self)
        if not self._ended:
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, cpu_threads: int | None = None, launch: Callable[[], EngineLaunch] | None = None
    ) -> None:
        """Start the engine process and wait until its model is loaded; a failure to load raises here.
        `cpu_threads`: torch's thread count in the engine process (None: torch's default). `launch`: how to
        start it elsewhere (a data-parallel replica: heron/engine/replica_launch.py); default a local process."""
        launch = launch or functools.partial(spawn_engine_process, config, cpu_threads)
        self._proc, self._commands, self._events = launch()
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="heron-tokenize")
        atexit.register(self.shutdown)
        try:
            ready = self._events.recv()
        except EOFError:
            self._proc.join(5)
            code = self._proc.exitcode
            raise EngineStartError(f"the engine process exited while loading (exit code {code})") from None
        if isinstance(ready, EngineDead):
            self._proc.join(30)
            raise EngineStartError(f"the engine could not start: {ready.reason}")
        info = ready.info
        self.info: ServingInfo = info
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self.tokenizer = info.tokenizer
        self._logprobs = LogprobTexts(info.tokenizer)  # the requests' Logprob objects, made here
        self.generation_defaults: dict = info.generation_defaults
        self.dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._writer = threading.Thread(target=self._write, name="heron-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="heron-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @classmethod
    def from_config(cls, config: EngineConfig, cpu_threads: int | None = None) -> AsyncLLM:
        return cls(config, cpu_threads)

    def get_stats(self) -> EngineStats:
        """The engine's snapshot after its latest step."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        """Requests sent and not yet finished or closed (a data-parallel router's load)."""
        return len(self._streams)

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` (on the reader thread) when the engine dies; at once if it has."""
        self._death_callbacks.append(callback)
        if self.dead is not None:
            _call_quietly(callback, self.dead)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        user: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> RequestStream:
        """Send a request to the engine and return its stream once the engine has accepted it. Its rejection
        raises ValueError (the message starts with the field at fault); a dead engine EngineDeadError.
        Cancelled while waiting, the request is aborted. `user`: the session, for a data-parallel router
        (one engine ignores it); `prompt_token_ids`: a text prompt's ids when the caller has made them."""
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = prompt_token_ids
        if text is not None and prompt_ids is None:
            prompt_ids = await self.tokenize(text, add_special_tokens)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        # The engine never sends the prompt back: its outputs take it from here.
        prompt_ids = list(prompt) if text is None else prompt_ids
        outputs = OutputAssembler(request_id, text, prompt_ids, params.output_kind, self._logprobs)
        stream = RequestStream(self, request_id, outputs)
        self._streams[request_id] = stream
        # Checked after registering: the reader sets `dead` before it tells the registered streams, so a
        # stream it missed sees `dead` here.
        if self.dead is not None:
            self._unregister(stream)
            raise self._dead_error(self.dead)
        self._outbox.put(
            AddRequest(
                request_id, prompt, prompt_ids, params, priority, add_special_tokens, lora_request, pooling_params
            )
        )
        try:
            await stream.accepted()
        except BaseException:
            stream.close()
            raise
        return stream

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Have the engine read and check an adapter now (a server loading it at runtime), so that a bad one is
        refused here rather than at its first request: raises its ValueError, or EngineDeadError."""
        request_id = f"add-lora-{lora_request.lora_int_id}"
        # The engine answers as it answers a request; a stream with no outputs receives that answer.
        stream = RequestStream(self, request_id, OutputAssembler(request_id, None, [], RequestOutputKind.DELTA))
        self._streams[request_id] = stream
        if self.dead is not None:
            self._unregister(stream)
            raise self._dead_error(self.dead)
        self._outbox.put(AddLoRA(request_id, lora_request))
        try:
            await stream.accepted()
        finally:
            self._unregister(stream)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from the engine's host cache (requests already queued with it still run)."""
        self._outbox.put(RemoveLoRA(lora_int_id))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs (of params.output_kind) until the request finishes. Invalid requests raise ValueError
        before the first output; leaving the iteration early (or being cancelled) aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority, add_special_tokens, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def encode(
        self,
        prompt: str | list[int],
        params: PoolingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> EmbeddingRequestOutput:
        """A pooling engine's embedding of one prompt (ValueError for what the engine refuses: the message
        starts with the field at fault). Cancelled, the request is aborted."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = await self.tokenize(prompt, add_special_tokens)
        if isinstance(prompt, list):  # cut here, so that the output names the tokens embedded
            prompt = params.truncate(prompt, self.max_model_len)
        stream = await self.add_request(
            prompt, PREFILL_ONLY, request_id, priority, add_special_tokens, pooling_params=params
        )
        try:
            async for _ in stream:  # (one output, when it finishes)
                pass
        finally:
            stream.close()
        return EmbeddingRequestOutput(request_id, EmbeddingOutput(stream.embedding or []), prompt)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """Text's ids, made here so that the engine process's steps never wait on tokenizing a burst of new
        requests. None without a tokenizer (the engine then rejects a text prompt)."""
        if self.tokenizer is None:
            return None
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return encode() if len(text) <= TOKENIZE_INLINE_CHARS else await self._on_tokenizer_thread(encode)

    async def detokenize(self, token_ids: list[int]) -> str:
        """Ids' text; long lists on the tokenizer's thread, as in `tokenize`."""
        decode = functools.partial(self.tokenizer.decode, token_ids)
        return decode() if len(token_ids) * 4 <= TOKENIZE_INLINE_CHARS else await self._on_tokenizer_thread(decode)

    async def _on_tokenizer_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    def abort(self, request_id: str) -> None:
        """Abort in the engine; safe for an id the engine has not seen yet (the abort follows the request
        down the same pipe) or no longer knows."""
        self._outbox.put(AbortRequest(request_id))

    def abort_all(self, message: str) -> None:
        """Abort every request in flight; each caller gets RequestAbortedError(message). On the loop."""
        for stream in list(self._streams.values()):
            stream._fail(RequestAbortedError(message))
            if not stream._ended:
                stream._ended = True
                self.abort(stream.request_id)

    def _dead_error(self, error: BaseException) -> EngineDeadError:
        """What callers get once the engine has died of `error`."""
        return EngineDeadError(f"the engine has stopped: {error!r}")

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def shutdown(self) -> None:
        """Stop the engine process (it stops its tensor-parallel workers); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(Shutdown())
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._outbox.put(None)
        self._tokenizer_thread.shutdown(wait=False)

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
                if isinstance(msg, StepOutputs):
                    self._stats = msg.stats
                    self._dispatch(msg.deltas)
                elif isinstance(msg, Added):
                    stream = self._streams.get(msg.request_id)
                    if stream is not None:  # gone: its caller left, and its abort follows
                        error = None if msg.rejection is None else _rebuild(*msg.rejection)
                        _post(stream.loop, stream._on_added, error)
                else:
                    assert isinstance(msg, EngineDead), msg
                    raise RuntimeError(msg.reason)
        except BaseException as e:  # noqa: BLE001 - everything waiting must hear of it
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Tell every caller still listening, then whoever asked (`on_dead`). Never raises: it runs last on
        the reader thread, and a failure here would leave streams hanging."""
        if self._stopping:
            return
        if isinstance(error, EOFError | OSError):
            self._proc.join(1)
            error = RuntimeError(f"the engine process exited (exit code {self._proc.exitcode})")
        self.dead = error
        logger.error("the engine has stopped: %s", error)
        for stream in list(self._streams.values()):
            _post(stream.loop, stream._fail, self._dead_error(error))
        for callback in self._death_callbacks:
            _call_quietly(callback, error)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        """Hand one step's outputs to their event loops, one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, delta))
        for loop, items in by_loop.items():
            _post(loop, _deliver, items)


def _deliver(items: list[tuple[RequestStream, RequestDelta]]) -> None:
    for stream, delta in items:
        stream._on_output(delta)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # that loop is closed: nobody is left to tell
        pass


def _call_quietly(callback: Callable[[BaseException], None], error: BaseException) -> None:
    try:
        callback(error)
    except Exception:  # noqa: BLE001 - one listener's failure must not keep the others from hearing
        logger.exception("a callback on the engine's death failed")


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
