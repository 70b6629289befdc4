"""What completions and chat share: model names, errors, sampling parameters, admission, client
disconnects, and the latency metrics taken as outputs stream by.

A request is started before any response is sent: its first output is awaited, so that everything the
engine rejects (a prompt too long, max_tokens that cannot fit) is a clean 400 and never an error in the
middle of an event stream. From then on the caller owns one async iterator of cumulative outputs per
prompt; closing it, or being cancelled, aborts the request in the engine and frees its blocks."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from heron.engine.async_llm import AsyncLLM, EngineDeadError
from heron.entrypoints.openai.protocol import ChatMessageParam, ErrorInfo, ErrorResponse, SamplingRequest
from heron.metrics import ServerMetrics
from heron.outputs import Logprobs, RequestOutput
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=self.status)


class ClientDisconnected(Exception):
    """The client hung up before the answer was ready; nobody is left to answer."""


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


def sse_error(e: EngineDeadError) -> str:
    """The engine died mid-stream: the status line is long gone, so the error travels as an event."""
    return sse(ApiError(503, str(e), code="engine_dead").response().body.decode())


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client hangs up. Cancelling closes the engine streams that
    `work` reads, which aborts their requests."""
    task = asyncio.ensure_future(work)

    async def hung_up() -> None:
        # The body has been read: the next message is the disconnect (or the end of the response).
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(hung_up())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():  # the client left, or we are cancelled ourselves
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientDisconnected
    return task.result()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as their items come, tagged with the stream's index; closing the merge
    closes them all. One stream (the usual request) is passed through: no task and no wait per item."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def last(stream: AsyncIterator[T]) -> T:
    async with aclosing(stream):
        async for item in stream:  # noqa: B007 - the last one is the answer
            pass
    return item


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        metrics: ServerMetrics,
        max_waiting_requests: int | None = None,
        log_requests: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        self.num_waiting = 0  # requests accepted here that have no output yet; bounded by --max-waiting-requests
        self._generation_defaults = engine.generation_defaults

    def model_name(self, asked: str | None) -> str:
        """The name to report for a request; 404 for a model this server does not serve."""
        if asked is None:
            return self.served_model_names[0]
        if asked not in self.served_model_names:
            raise ApiError(404, f"The model `{asked}` does not exist.", param="model", code="model_not_found")
        return asked

    def sampling_params(
        self,
        req: SamplingRequest,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        renames: dict[str, str] | None = None,
    ) -> SamplingParams:
        """Build SamplingParams from a request; its ValueError names a field, which becomes `param` (renamed
        where the request calls it otherwise, as chat does max_completion_tokens)."""
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true.", param="stream_options")
        try:
            logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids.", param="logit_bias") from None
        if any(not -100 <= v <= 100 for v in logit_bias.values()):
            raise ApiError(400, "logit_bias values must be in [-100, 100].", param="logit_bias")
        defaults = self._generation_defaults

        def pick(name: str, value):
            return value if value is not None else defaults.get(name, getattr(SamplingParams, name))

        try:
            return SamplingParams(
                n=req.n,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", req.repetition_penalty),
                temperature=pick("temperature", req.temperature),
                top_p=pick("top_p", req.top_p),
                top_k=pick("top_k", req.top_k),
                min_p=req.min_p,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias or None,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=(renames or {}).get(field, field)) from None

    async def start(
        self,
        raw: Request,
        request_id: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int,
        add_special_tokens: bool,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> list[AsyncIterator[RequestOutput]]:
        """Submit one engine request per prompt and wait for each one's first output. The engine's
        rejections become 400s naming `prompt_param` or `max_tokens_param`."""
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + len(prompts) > limit:
            raise ApiError(
                503,
                f"The server is overloaded: {self.num_waiting} requests are waiting "
                f"(--max-waiting-requests {limit}). Retry later.",
                code="server_overloaded",
            )
        streams = [
            self._generate(f"{request_id}-{i}", p, params, priority, add_special_tokens) for i, p in enumerate(prompts)
        ]
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            await until_disconnected(raw, asyncio.gather(*tasks))
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
            if isinstance(e, ValueError):  # the engine's messages start with the field they are about
                field = str(e).split(" ", 1)[0]
                param = {"max_tokens": max_tokens_param, "n": "n"}.get(field, prompt_param)
                raise ApiError(400, str(e), param=param) from None
            if isinstance(e, EngineDeadError):
                raise ApiError(503, str(e), code="engine_dead") from None
            raise
        return [_prepend(t.result(), s) for t, s in zip(tasks, streams)]

    async def _generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int, add_special_tokens: bool
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate plus the server's bookkeeping: the waiting count, latencies, request logs."""
        if self.log_requests:
            logger.info("Received request %s: prompt: %r, params: %s", request_id, prompt, params)
        self.num_waiting += 1
        waiting = True
        sent, sent_at = 0, 0.0
        try:
            async with aclosing(
                self.engine.generate(
                    prompt, params, request_id, priority=priority, add_special_tokens=add_special_tokens
                )
            ) as outputs:
                async for out in outputs:
                    if waiting:
                        self.num_waiting -= 1
                        waiting = False
                    m = out.metrics
                    n = len(out.outputs[0].token_ids)
                    if sent and n > sent and m.last_token_time is not None:
                        self.metrics.observe_tokens(n - sent, m.last_token_time - sent_at)
                    sent, sent_at = n, m.last_token_time or 0.0
                    if out.finished:
                        self.metrics.observe_finished(m)
                        if self.log_requests:
                            logger.info(
                                "Finished request %s: %s", request_id, [(c.text, c.finish_reason) for c in out.outputs]
                            )
                    yield out
        finally:
            if waiting:
                self.num_waiting -= 1

    def render(self, messages: list[ChatMessageParam], add_generation_prompt: bool = True) -> str:
        """The conversation as one prompt string, through the model's chat template (or --chat-template)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(
                400, "This model has no chat template; start the server with --chat-template.", param="messages"
            )
        conversation = []
        for m in messages:
            content = (
                m.content
                if isinstance(m.content, str) or m.content is None
                else "\n".join(part.text for part in m.content)
            )
            # Templates know "system"; "developer" is OpenAI's newer name for it.
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            conversation.append(msg)
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - a template raises whatever it likes on a conversation it rejects
            raise ApiError(400, f"The chat template rejected the messages: {e}", param="messages") from None

    # -- logprobs ---------------------------------------------------------------------------------------------

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one instance per server; token strings never change
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top_logprobs(self, lps: Logprobs, k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of a position (its dict holds the sampled token and the top k)."""
        return sorted(lps.items(), key=lambda kv: -kv[1])[:k]


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
