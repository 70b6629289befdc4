"""POST /v1/completions: one engine request per prompt, n samples each; choice i*n + j is prompt i's
sample j, as in OpenAI's API."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from heron.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from heron.entrypoints.openai.serving_engine import (
    ApiError,
    ClientDisconnected,
    EventStream,
    OpenAIServing,
    api_error,
    last,
    merge,
    sse,
    until_disconnected,
)
from heron.outputs import Logprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> CompletionResponse | EventStream:
        model = self.model_name(req.model)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported.", param="suffix")
        prompts = _prompts(req.prompt)
        echo_lps = req.logprobs if req.echo and req.logprobs is not None else None
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_lps)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = await self.start(
            raw, request_id, prompts, params, req.priority, add_special_tokens=True, prompt_param="prompt"
        )
        head = CompletionResponse(id=request_id, model=model, choices=[])
        if req.stream:
            return EventStream(self._stream(head, req, group.outputs), group)
        try:
            finals: list[RequestOutput] = await until_disconnected(raw, asyncio.gather(*map(last, group.outputs)))
        except ClientDisconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's death, the server's shutdown, a later prompt rejected
            raise api_error(e) from None
        finally:
            group.close()
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                text, logprobs = c.text, None
                if req.echo:
                    text = self._prompt_text(out) + text
                if req.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    if req.echo:
                        self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, 0)
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, _end(logprobs))
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason
                    )
                )
        return head.model_copy(update={"choices": choices, "usage": _usage(finals)})

    async def _stream(
        self, head: CompletionResponse, req: CompletionRequest, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice that advanced, each with the text (and tokens) new since
        the last; a usage chunk when asked; then [DONE]."""
        sent_text: dict[int, int] = {}  # choice index -> characters sent (echoed prompt included)
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()  # a finished sample stays in its request's later outputs: said once
        latest: dict[int, RequestOutput] = {}
        try:
            async with aclosing(merge(streams)) as merged:
                async for i, out in merged:
                    latest[i] = out
                    for c in out.outputs:
                        idx = i * req.n + c.index
                        if idx in finished:
                            continue
                        first = idx not in sent_text
                        text = c.text[sent_text.get(idx, 0) :]
                        done_ids = sent_tokens.get(idx, 0)
                        new_ids = c.token_ids[done_ids:]
                        if not (first or text or new_ids or c.finish_reason):
                            continue
                        logprobs = CompletionLogProbs() if req.logprobs is not None else None
                        if first and req.echo:
                            text = self._prompt_text(out) + text
                            if logprobs is not None:
                                self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, 0)
                        if logprobs is not None:
                            self._add_logprobs(
                                logprobs,
                                new_ids,
                                (c.logprobs or [])[done_ids:],
                                _end(logprobs) if first else sent_text[idx],
                            )
                        sent_text[idx] = sent_text.get(idx, 0) + len(text)
                        sent_tokens[idx] = len(c.token_ids)
                        if c.finish_reason:
                            finished.add(idx)
                        choice = CompletionResponseChoice(
                            index=idx, text=text, logprobs=logprobs, finish_reason=c.finish_reason
                        )
                        yield sse(head.model_copy(update={"choices": [choice]}).model_dump_json())
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = _usage([latest[i] for i in sorted(latest)])
                yield sse(head.model_copy(update={"usage": usage}).model_dump_json())
        except Exception as e:  # noqa: BLE001 - the status line is long gone: the error is an event
            yield api_error(e).event()
        yield sse("[DONE]")

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _add_logprobs(
        self, into: CompletionLogProbs, token_ids: list[int], lps: list[Logprobs | None] | None, offset: int
    ) -> None:
        """Append tokens in OpenAI's legacy layout: each token's logprob and its top alternatives, sampled
        token included (so up to logprobs + 1 of them). A prompt's first token has none."""
        lps = lps or []
        for j, tok in enumerate(token_ids):
            s = self.token_str(tok)
            lp = lps[j] if j < len(lps) else None
            into.tokens.append(s)
            into.text_offset.append(offset)
            into.token_logprobs.append(lp[tok] if lp is not None else None)
            into.top_logprobs.append({self.token_str(t): v for t, v in lp.items()} if lp is not None else None)
            offset += len(s)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _end(lp: CompletionLogProbs) -> int:
    """The text offset just past the last token in `lp`."""
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0


def _usage(outs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
