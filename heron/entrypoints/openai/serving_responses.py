"""POST /v1/responses, OpenAI's Responses API over the chat path: `instructions` and the input (text or
message items) go through the chat template, one sample is drawn, and the answer is one output message;
streamed, it is the API's typed events (response.created ... response.output_text.delta ...
response.completed). Nothing is stored: `store` true and `previous_response_id` are refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.protocol import ChatMessageParam, ChatTemplateFields, SamplingRequest, UsageInfo
from heron.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from heron.entrypoints.openai.serving_engine import EventStream, OpenAIServing, RequestGroup, fragments


class OpenAIServingResponses(OpenAIServing):
    async def create(self, req: ResponsesRequest, raw: Request) -> ResponseObject | StreamingResponse:
        model = self.model_name(req.model)
        if req.text is not None and req.text.format is not None and req.text.format.type != "text":
            raise ApiError(400, f"text.format {req.text.format.type} is not supported yet.", param="text.format")
        if req.prompt is not None:
            raise ApiError(400, "prompt (a stored prompt template) is not supported: Heron keeps none.", param="prompt")
        if req.top_logprobs:
            raise ApiError(400, "top_logprobs is not supported yet on /v1/responses.", param="top_logprobs")
        if req.tools or req.tool_choice not in (None, "none") or req.parallel_tool_calls:
            field = (
                "tools"
                if req.tools
                else "tool_choice"
                if req.tool_choice not in (None, "none")
                else "parallel_tool_calls"
            )
            raise ApiError(
                400, f"{field} is not supported yet on /v1/responses: use /v1/chat/completions.", param=field
            )
        sampling = SamplingRequest(
            temperature=req.temperature, top_p=req.top_p, stream=req.stream, store=req.store, user=req.user
        )
        params = self.sampling_params(
            sampling, max_tokens=req.max_output_tokens, logprobs=None, renames={"max_tokens": "max_output_tokens"}
        )
        prompt = self.render(_messages(req), ChatTemplateFields())
        response_id = f"resp_{uuid.uuid4().hex}"
        group = await self.start(
            raw,
            response_id,
            [prompt],
            params,
            priority=0,
            add_special_tokens=False,
            prompt_param="input",
            max_tokens_param="max_output_tokens",
            model=model,
        )
        head = ResponseObject(
            id=response_id,
            model=model,
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return EventStream(self._events(group, head, message_id), group)
        texts: list[str] = []
        finish: list[str | None] = [None]

        def add(fragment) -> None:
            texts.append(fragment[2].text)
            finish[0] = fragment[2].finish_reason

        usage = await self.answer(raw, group, 1, add)
        return _finished(head, message_id, "".join(texts), finish[0], usage)

    async def _events(self, group: RequestGroup, head: ResponseObject, message_id: str) -> AsyncIterator[str]:
        """The Responses API's stream: typed events, each numbered; an error on the way is an `error` event."""
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=head.model_dump())
        yield event("response.in_progress", response=head.model_dump())
        item = OutputMessage(id=message_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=item.model_dump())
        yield event("response.content_part.added", part=OutputText(text="").model_dump(), **where)
        usage, texts, finish = UsageInfo(), [], None
        try:
            async for _, _, c in fragments(group, 1, usage):
                finish = c.finish_reason
                if c.text:
                    texts.append(c.text)
                    yield event("response.output_text.delta", delta=c.text, logprobs=[], **where)
        except Exception as e:  # noqa: BLE001 - said in the stream, in the API's terms
            err = api_error(e)
            yield event("error", code=err.code, message=err.message, param=err.param)
            return
        done = _finished(head, message_id, "".join(texts), finish, usage)
        message = done.output[0]
        yield event("response.output_text.done", text=message.content[0].text, logprobs=[], **where)
        yield event("response.content_part.done", part=message.content[0].model_dump(), **where)
        yield event("response.output_item.done", output_index=0, item=message.model_dump())
        # response.completed also when cut by max_output_tokens (its status says "incomplete"), as vLLM does:
        # the openai SDK's stream helper waits for that event.
        yield event("response.completed", response=done.model_dump())


def _messages(req: ResponsesRequest) -> list[ChatMessageParam]:
    """`instructions` as the system message, then the input's messages."""
    messages = [] if req.instructions is None else [ChatMessageParam(role="system", content=req.instructions)]
    if isinstance(req.input, str):
        return [*messages, ChatMessageParam(role="user", content=req.input)]
    for item in req.input:
        content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
        messages.append(ChatMessageParam(role=item.role, content=content))
    return messages


def _finished(head: ResponseObject, message_id: str, text: str, finish: str | None, usage: UsageInfo) -> ResponseObject:
    cut = finish == "length"
    status = "incomplete" if cut else "completed"
    return head.model_copy(
        update={
            "status": status,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "output": [OutputMessage(id=message_id, status=status, content=[OutputText(text=text)])],
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            ),
        }
    )
