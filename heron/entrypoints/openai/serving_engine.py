"""What completions and chat share: model names, sampling parameters, a request's size and admission,
client disconnects, and the latency metrics taken as outputs stream by.

A request is checked, and accepted by the engine, before any response is sent: what the engine rejects (a
prompt too long, max_tokens that cannot fit) is a clean 400, not an error inside an event stream, and a
stream's headers go out as soon as its requests are queued, before their first token. From then on the
caller owns one async iterator of delta outputs per prompt; closing it, or being cancelled, aborts the
request in the engine and frees its blocks. `fragments` is the one loop that reads them, for streams
(`events`) and plain answers (`answer`) alike; each endpoint has one function that makes a fragment into a
choice of its format.

Fairness: a request's prompts enter the engine at most WAITING_PER_REQUEST at a time (the next one when
one of them has its first token), so that a request of many prompts queues behind a later small request
by a few prompts at most instead of all of them. Only the first ones are checked before the response:
a later prompt the engine rejects fails a plain request with a 400 and a stream with an error event.

Length: the request path every endpoint shares, from fields to sampling parameters (with the field
policy's cross-field rules, best_of, beam search and structured outputs) to the chat template, admission and
logprobs; the next split is the sampling-parameter building into a module of its own."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from heron.engine.async_llm import AsyncLLM, RequestStream
from heron.entrypoints.openai.admission import Admission, Overloaded, Ticket
from heron.entrypoints.openai.errors import ApiError, api_error, sse
from heron.entrypoints.openai.limits import RequestLimits
from heron.entrypoints.openai.protocol import (
    ChatMessageParam,
    ChatTemplateFields,
    OpenAIBaseModel,
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
    UsageInfo,
)
from heron.entrypoints.openai.serving_models import OpenAIServingModels
from heron.entrypoints.openai.serving_tools import template_tool_calls
from heron.entrypoints.openai.structured_outputs import structured_outputs_params
from heron.logprobs import Logprob, Logprobs
from heron.metrics import ServerMetrics
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import RANGES, BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
C = TypeVar("C", bound=OpenAIBaseModel)

# Variables the server sets itself when it renders a chat template.
_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
)

WAITING_PER_REQUEST = 8


def message_text(m: ChatMessageParam) -> str:
    """A message's text; a list of text parts is joined by newlines."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return "\n".join(part.text for part in m.content)


class ClientDisconnected(Exception):
    """The client hung up before the answer was ready; nobody is left to answer."""


async def until_disconnected(raw: Request | None, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client hangs up. Cancelling closes the engine streams that
    `work` reads, which aborts their requests. No `raw` (run-batch's lines): no client to watch."""
    if raw is None:
        return await work
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


# A sample's news, with its choice index (prompt i's sample j is choice i * n + j) and its request's first
# output (the prompt, its ids and logprobs, for echo), in the order they come.
Fragment = tuple[int, RequestOutput, CompletionOutput]


async def fragments(group: RequestGroup, n: int, usage: UsageInfo) -> AsyncIterator[Fragment]:
    """The one loop over an HTTP request's delta outputs, for streams and plain answers alike: each sample's
    news (a sample's finish comes once); `usage` adds up as they come."""
    firsts: dict[int, RequestOutput] = {}
    async with aclosing(merge(group.outputs)) as merged:
        async for i, out in merged:
            if i not in firsts:  # a request's first output carries its prompt
                firsts[i] = out
                usage.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                yield i * n + c.index, firsts[i], c
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens


class RequestGroup:
    """The engine requests of one HTTP request, one per prompt: `outputs`, an iterator of each one's delta
    outputs (closing it aborts that request), and `close`, which ends them all and gives their places in the waiting
    queue back whether or not their iterators ever ran (a client can leave before its response starts)."""

    def __init__(self, tickets: list[Ticket]) -> None:
        self.tickets = tickets
        self.live: list[RequestStream] = []  # accepted by the engine
        self.outputs: list[AsyncIterator[RequestOutput]] = []
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for ticket in self.tickets:
            ticket.release()
        for stream in self.live:
            stream.close()


class EventStream(StreamingResponse):
    """Server-sent events of a request group, which ends with the response however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content)
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        metrics: ServerMetrics,
        admission: Admission,
        limits: RequestLimits,
        log_requests: bool = False,
        scheduling_policy: str = "fcfs",
        models: OpenAIServingModels | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        # The names it answers to: the server shares one (with its LoRA adapters) among the endpoints.
        self.models = models or OpenAIServingModels(engine, served_model_names)
        self.metrics = metrics
        self.admission = admission
        self.limits = limits
        self.log_requests = log_requests
        self.scheduling_policy = scheduling_policy
        self._generation_defaults = engine.generation_defaults

    def model_name(self, asked: str | None) -> str:
        """The name to report for a request (the base model's or a LoRA adapter's); 404 for a model this server
        does not serve."""
        return self.models.model_name(asked)

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
        self._check_policy_fields(req)
        n = req.n
        if req.best_of is not None and not req.use_beam_search:  # (with beam search, best_of is the beam width)
            if req.best_of > self.limits.max_n:
                why = f"best_of must be at most {self.limits.max_n} on this server, got {req.best_of}."
                raise ApiError(400, why, param="best_of")
            if req.best_of < req.n:
                raise ApiError(400, f"best_of ({req.best_of}) must be at least n ({req.n}).", param="best_of")
            if req.stream and req.best_of > req.n:
                raise ApiError(
                    400, "best_of is not supported with stream: candidates are ranked once all finish.", param="best_of"
                )
            # Candidates are ranked by their cumulative logprob, which the engine keeps when logprobs are asked.
            n, logprobs = req.best_of, 0 if logprobs is None else logprobs
            renames = {**(renames or {}), "n": "best_of"}
        if req.prompt_logprobs is not None:
            if req.stream:
                raise ApiError(400, "prompt_logprobs is not available with stream.", param="prompt_logprobs")
            prompt_logprobs = max(req.prompt_logprobs, prompt_logprobs or 0)
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and k > (most := self.limits.max_logprobs):
                field = (renames or {}).get(name, name)
                why = f"{field} ({k}) is more than this server's max_logprobs ({most}; --max-logprobs)."
                raise ApiError(400, why, param=field)
        defaults = self._generation_defaults
        structured = structured_outputs_params(req)

        def pick(name: str, value):
            return value if value is not None else defaults.get(name, getattr(SamplingParams, name))

        try:
            return SamplingParams(
                n=n,
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
                logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA,  # what the server sends: fragments() reads them as they come
                structured_outputs=structured,
                beam_search=_beam_search(req, max_tokens, logprobs),
            )
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=(renames or {}).get(field, field)) from None

    def _check_policy_fields(self, req: SamplingRequest) -> None:
        if req.store:
            raise ApiError(400, "store=true is not supported: Heron keeps no completions.", param="store")
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise ApiError(
                400,
                f"priority is {req.priority}, but the server schedules first come, first served; start it with "
                "--scheduling-policy priority.",
                param="priority",
            )

    @staticmethod
    def best(choices: dict[int, C], scores: dict[int, float], candidates: int, n: int) -> list[C]:
        """Each prompt's n choices of highest cumulative logprob among its `candidates` (best_of), numbered as
        the request's choices (prompt i's k-th best is choice i * n + k)."""
        if candidates == n:
            return [choices[i] for i in sorted(choices)]
        picked = []
        for prompt in range(len(choices) // candidates):
            ids = range(prompt * candidates, (prompt + 1) * candidates)
            for k, i in enumerate(sorted(ids, key=lambda i: -scores.get(i, float("-inf")))[:n]):
                choices[i].index = prompt * n + k
                picked.append(choices[i])
        return picked

    def prompt_logprobs(self, lps: list[Logprobs | None] | None) -> PromptLogprobs | None:
        """The prompt's logprobs as vLLM returns them: per position, token id -> logprob, rank and text, most
        likely first (the prompt token's rank is its rank in the vocabulary, past k when outside the top k)."""
        if lps is None:
            return None
        return [
            None
            if lp is None
            else {
                str(t): PromptLogprob(logprob=v.logprob, rank=v.rank, decoded_token=v.decoded_token)
                for t, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)
            }
            for lp in lps
        ]

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
        model: str | None = None,
        user: str | None = None,
    ) -> RequestGroup:
        """Check the request's size, take its places in the waiting queue (503 when full), submit its
        first prompts and return once the engine has accepted them. `model`: the request's checked model name,
        which picks its LoRA adapter, if it names one; `user` keeps a session on one data-parallel replica."""
        if (too_many := self.limits.check_seqs(len(prompts), params.n)) is not None:
            field, why = too_many
            raise ApiError(400, why, param=prompt_param if field == "prompt" else field)
        for p in prompts:
            if isinstance(p, str) and (why := self.limits.check_text(p)) is not None:
                raise ApiError(400, why, param=prompt_param)
        try:
            group = RequestGroup(self.admission.admit(len(prompts)))
        except Overloaded as e:
            raise api_error(e) from None
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        for _ in prompts:
            self.metrics.observe_params(params)
        if self.log_requests:
            for rid, p in zip(ids, prompts):
                logger.info("Received request %s: prompt: %r, params: %s", rid, p, params)
        submit = functools.partial(
            self.engine.add_request,
            params=params,
            priority=priority,
            add_special_tokens=add_special_tokens,
            lora_request=self.models.lora_request(model) if model is not None else None,
            user=user,
        )
        head = [asyncio.ensure_future(submit(p, request_id=rid)) for p, rid in zip(prompts, ids[:WAITING_PER_REQUEST])]
        try:
            group.live += await until_disconnected(raw, asyncio.gather(*head))
        except BaseException as e:
            for t in head:
                t.cancel()
            group.live += [
                r for r in await asyncio.gather(*head, return_exceptions=True) if isinstance(r, RequestStream)
            ]
            group.close()
            if isinstance(e, Exception) and not isinstance(e, ClientDisconnected):
                raise api_error(e, prompt_param, max_tokens_param) from None
            raise
        turns = asyncio.Semaphore(0)  # a later prompt enters the engine when an earlier one has its first token
        group.outputs = [self._track(rid, s, t, turns) for rid, s, t in zip(ids, group.live, group.tickets)]
        for i in range(len(head), len(prompts)):
            later = functools.partial(submit, prompts[i], request_id=ids[i])
            group.outputs.append(self._deferred(ids[i], later, group, group.tickets[i], turns))
        return group

    async def _deferred(
        self, request_id: str, submit, group: RequestGroup, ticket: Ticket, turns: asyncio.Semaphore
    ) -> AsyncIterator[RequestOutput]:
        try:
            await turns.acquire()
            if group.closed:
                return
            stream = await submit()
        except BaseException:
            ticket.release()
            turns.release()
            raise
        group.live.append(stream)
        async with aclosing(self._track(request_id, stream, ticket, turns)) as outputs:
            async for out in outputs:
                yield out

    async def _track(
        self, request_id: str, stream: RequestStream, ticket: Ticket, turns: asyncio.Semaphore
    ) -> AsyncIterator[RequestOutput]:
        """An accepted request's outputs plus the server's bookkeeping: its place in the waiting queue and its
        turn are given back at the first output, latencies observed, requests logged."""
        sent, sent_at = 0, 0.0  # the first sample's tokens so far, and when the last came
        generated: dict[int, int] = {}  # sample index -> tokens so far
        prompt_len = 0  # the prompt's ids come with the first output only
        waiting = True
        try:
            async for out in stream:
                if waiting:
                    waiting = False
                    ticket.release()
                    turns.release()
                m = out.metrics
                prompt_len = prompt_len or len(out.prompt_token_ids)
                for c in out.outputs:
                    generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                new = next((len(c.token_ids) for c in out.outputs if c.index == 0), 0)
                if sent and new and m.last_token_time is not None:
                    self.metrics.observe_tokens(new, m.last_token_time - sent_at)
                sent, sent_at = sent + new, m.last_token_time or 0.0
                if out.finished:
                    self.metrics.observe_finished(m, prompt_len, [generated[i] for i in sorted(generated)])
                    if self.log_requests:
                        logger.info(
                            "Finished request %s: %s", request_id, [(c.text, c.finish_reason) for c in out.outputs]
                        )
                yield out
        finally:
            stream.close()
            if waiting:
                ticket.release()
                turns.release()

    async def answer(self, raw: Request, group: RequestGroup, n: int, add: Callable[[Fragment], None]) -> UsageInfo:
        """A plain answer: every fragment handed to `add` as it comes, until all the requests finish (or the
        client leaves); returns the usage."""
        usage = UsageInfo()

        async def gather() -> None:
            async for fragment in fragments(group, n, usage):
                add(fragment)

        try:
            await until_disconnected(raw, gather())
        except ClientDisconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's death, the server's shutdown, a later prompt rejected
            raise api_error(e) from None
        finally:
            group.close()
        return usage

    async def events(
        self,
        group: RequestGroup,
        n: int,
        chunk: Callable[[Fragment], OpenAIBaseModel | None],
        opening: Sequence[OpenAIBaseModel] = (),
        usage_chunk: Callable[[UsageInfo], OpenAIBaseModel] | None = None,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        """A stream: server-sent events of the `opening` chunks, then of each fragment's chunk (None: nothing
        to say), the usage chunk when asked, then [DONE]. With `continuous_usage` every chunk carries the
        usage so far. Its status line is long gone, so an error on the way is an event."""
        usage = UsageInfo()

        def event(c: OpenAIBaseModel) -> str:
            if continuous_usage:
                c.usage = usage.model_copy(update={"total_tokens": usage.prompt_tokens + usage.completion_tokens})
            return sse(c.model_dump_json())

        try:
            for c in opening:
                yield event(c)
            async for fragment in fragments(group, n, usage):
                if (c := chunk(fragment)) is not None:
                    yield event(c)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage).model_dump_json())
        except Exception as e:  # noqa: BLE001 - said in the stream, in the API's terms
            yield api_error(e).event()
        yield sse("[DONE]")

    def render(
        self,
        messages: list[ChatMessageParam],
        opts: ChatTemplateFields,
        tools: list[dict] | None = None,
        param: str = "messages",
    ) -> str:
        """The conversation as one prompt string, through the model's chat template (or --chat-template), with
        the request's template options and its tools (as OpenAI writes them) where it has some. `param`: the
        field the conversation came in, which its 400s name."""
        if opts.continue_final_message and opts.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
                "to false to continue the last message.",
                param="continue_final_message",
            )
        extra = opts.chat_template_kwargs or {}
        if reserved := sorted(_TEMPLATE_ARGS & extra.keys()):
            raise ApiError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}: the request's fields do.",
                param="chat_template_kwargs",
            )
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "This model has no chat template; start the server with --chat-template.", param=param)
        if len(messages) > self.limits.max_model_len:
            raise ApiError(
                400,
                f"There are {len(messages)} messages: more than max_model_len ({self.limits.max_model_len}) tokens "
                "could hold.",
                param=param,
            )
        conversation = []
        for m in messages:
            # Templates know "system"; "developer" is OpenAI's newer name for it.
            msg = {"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = template_tool_calls(m.tool_calls, param)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            conversation.append(msg)
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                tokenize=False,
                add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message,
                **extra,
            )
        except Exception as e:  # noqa: BLE001 - a template raises whatever it likes on a conversation it rejects
            raise ApiError(400, f"The chat template rejected the messages: {e}", param=param) from None

    # -- logprobs ---------------------------------------------------------------------------------------------

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one instance per server; token strings never change
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top_logprobs(self, lps: Logprobs, k: int) -> list[Logprob]:
        """The k most likely tokens of a position (its dict holds the sampled token and the top k)."""
        return sorted(lps.values(), key=lambda v: -v.logprob)[:k]


def _beam_search(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> BeamSearchParams | None:
    """use_beam_search: a beam search as wide as best_of (or n), returning its n best beams (the engine's
    max_tokens, left out, is the context's room). Its output comes at the end only: no stream, no logprobs."""
    if not req.use_beam_search:
        return None
    if req.stream:
        raise ApiError(400, "use_beam_search does not support streaming.", param="stream")
    if logprobs is not None:
        raise ApiError(400, "use_beam_search does not support logprobs.", param="logprobs")
    try:
        return BeamSearchParams(
            beam_width=req.best_of or req.n,
            max_tokens=max_tokens or int(RANGES["max_tokens"].high),
            ignore_eos=req.ignore_eos,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            early_stopping=req.early_stopping,
        )
    except ValueError as e:  # its width, the only field not checked already
        param = "best_of" if req.best_of else "n"
        raise ApiError(400, f"{e} ({param} is the beam width with use_beam_search)", param=param) from None
