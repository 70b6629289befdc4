"""POST /v1/chat/completions: messages -> the model's chat template (with the generation prompt) -> one
engine request with n samples."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from heron.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
)
from heron.entrypoints.openai.serving_engine import (
    ApiError,
    ClientDisconnected,
    EventStream,
    OpenAIServing,
    api_error,
    last,
    sse,
    until_disconnected,
)
from heron.outputs import Logprobs, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> ChatCompletionResponse | EventStream:
        model = self.model_name(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(
            req,
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            renames={"max_tokens": max_param, "logprobs": "top_logprobs"},
        )
        prompt = self.render(req.messages)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # The template already holds the special tokens (BOS and the like): none are added again.
        group = await self.start(
            raw,
            request_id,
            [prompt],
            params,
            req.priority,
            add_special_tokens=False,
            prompt_param="messages",
            max_tokens_param=max_param,
        )
        [stream] = group.outputs
        if req.stream:
            return EventStream(self._stream(request_id, model, req, stream), group)
        try:
            out: RequestOutput = await until_disconnected(raw, last(stream))
        except ClientDisconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's death, the server's shutdown
            raise api_error(e) from None
        finally:
            group.close()
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(content=c.text),
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(out))

    async def _stream(
        self, request_id: str, model: str, req: ChatCompletionRequest, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[str]:
        """Server-sent events: first the role for each choice, then the text new since the last chunk, the
        finish reason on the last one, a usage chunk when asked, and [DONE]."""
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return sse(c.model_dump_json())

        for i in range(req.n):
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        sent_text = [0] * req.n
        sent_tokens = [0] * req.n
        finished: set[int] = set()  # a finished sample stays in the request's later outputs: said once
        out = None
        try:
            async with aclosing(stream):
                async for out in stream:
                    for c in out.outputs:
                        i = c.index
                        if i in finished:
                            continue
                        text = c.text[sent_text[i] :]
                        new_ids = c.token_ids[sent_tokens[i] :]
                        lps = (c.logprobs or [])[sent_tokens[i] :]
                        sent_text[i] += len(text)
                        sent_tokens[i] = len(c.token_ids)
                        if not (text or c.finish_reason or (req.logprobs and new_ids)):
                            continue
                        if c.finish_reason:
                            finished.add(i)
                        yield chunk(
                            [
                                ChatCompletionStreamChoice(
                                    index=i,
                                    delta=DeltaMessage(content=text) if text else DeltaMessage(),
                                    finish_reason=c.finish_reason,
                                    logprobs=self._logprobs(new_ids, lps, req.top_logprobs or 0)
                                    if req.logprobs
                                    else None,
                                )
                            ]
                        )
            if req.stream_options is not None and req.stream_options.include_usage and out is not None:
                yield chunk([], usage=_usage(out))
        except Exception as e:  # noqa: BLE001 - the status line is long gone: the error is an event
            yield api_error(e).event()
        yield sse("[DONE]")

    def _logprobs(self, token_ids: list[int], lps: list[Logprobs] | None, k: int) -> ChatChoiceLogprobs:
        content = []
        for tok, lp in zip(token_ids, lps or []):
            s = self.token_str(tok)
            top = [
                ChatTopLogprob(token=self.token_str(t), logprob=v, bytes=list(self.token_str(t).encode()))
                for t, v in self.top_logprobs(lp, k)
            ]
            content.append(ChatTokenLogprob(token=s, logprob=lp[tok], bytes=list(s.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)


def _usage(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion,
        total_tokens=len(out.prompt_token_ids) + completion,
    )
