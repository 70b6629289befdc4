"""POST /v1/responses, OpenAI's Responses API over the chat path: `instructions` and the input (text, message
items, and the function calls and their outputs of earlier turns) go through the chat template, one sample is
drawn, and its text becomes the output items: a message for its content and a function_call per tool call,
read as in chat (serving_tools.py: the tool choice's grammar, or the --tool-call-parser). `text.format` is
chat's response_format (structured_outputs.py). Streamed, the same items are built as the text comes and
each step is one of the API's typed events (response.created ... response.output_text.delta /
response.function_call_arguments.delta ... response.completed), so the stream and the plain answer agree.
Nothing is stored: `store` true and `previous_response_id` are refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.protocol import (
    ChatCompletionMessageToolCallParam,
    ChatMessageParam,
    ChatTemplateFields,
    FunctionCallParam,
    SamplingRequest,
    UsageInfo,
)
from heron.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputText,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from heron.entrypoints.openai.serving_engine import EventStream, OpenAIServing, RequestGroup, fragments
from heron.entrypoints.openai.serving_tools import CallExtractor, ToolCalling
from heron.entrypoints.openai.structured_outputs import checked, output_format

Event = tuple[str, dict[str, Any]]  # (type, fields): numbered and sent by the stream


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *, tool_call_parser: str | None = None, **common) -> None:
        super().__init__(**common)
        self.tool_call_parser = tool_call_parser  # for tool_choice "auto"; None: not enabled (as in chat)

    async def create(self, req: ResponsesRequest, raw: Request) -> ResponseObject | StreamingResponse:
        model = self.model_name(req.model)
        if req.prompt is not None:
            raise ApiError(400, "prompt (a stored prompt template) is not supported: Heron keeps none.", param="prompt")
        if req.top_logprobs:
            raise ApiError(400, "top_logprobs is not supported yet on /v1/responses.", param="top_logprobs")
        tools = ToolCalling(*req.chat_tools(), req.parallel_tool_calls, self.tool_call_parser)
        fmt = req.text.format if req.text is not None else None
        constraint = output_format(fmt.type, fmt.schema_, "text.format") if fmt is not None else None
        sampling = SamplingRequest(
            temperature=req.temperature, top_p=req.top_p, stream=req.stream, store=req.store, user=req.user
        )
        params = self.sampling_params(
            sampling, max_tokens=req.max_output_tokens, logprobs=None, renames={"max_tokens": "max_output_tokens"}
        )
        params.structured_outputs = None if constraint is None else checked("text.format", constraint)
        tools.apply(params)
        prompt = self.render(_messages(req), ChatTemplateFields(), tools=tools.tools, param="input")
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
            user=req.user,
        )
        choice = req.tool_choice if req.tool_choice is not None else tools.choice
        head = ResponseObject(
            id=response_id,
            model=model,
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            parallel_tool_calls=req.parallel_tool_calls,
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
        )
        items = OutputItems(tools.extractor())
        if req.stream:
            return EventStream(self._events(group, head, items), group)
        finish: list[str | None] = [None]

        def add(fragment) -> None:
            items.feed(fragment[2].text, fragment[2].finish_reason)
            finish[0] = fragment[2].finish_reason

        usage = await self.answer(raw, group, 1, add)
        return _finished(head, items, finish[0], usage)

    async def _events(self, group: RequestGroup, head: ResponseObject, items: OutputItems) -> AsyncIterator[str]:
        """The Responses API's stream: typed events, each numbered; an error on the way is an `error` event."""
        seq = 0

        def event(kind: str, data: dict[str, Any]) -> str:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **data}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        yield event("response.created", {"response": head.model_dump()})
        yield event("response.in_progress", {"response": head.model_dump()})
        for e in items.start():
            yield event(*e)
        usage, finish = UsageInfo(), None
        try:
            async for _, _, c in fragments(group, 1, usage):
                finish = c.finish_reason
                for e in items.feed(c.text, finish):
                    yield event(*e)
        except Exception as e:  # noqa: BLE001 - said in the stream, in the API's terms
            err = api_error(e)
            yield event("error", {"code": err.code, "message": err.message, "param": err.param})
            return
        # response.completed also when cut by max_output_tokens (its status says "incomplete"), as vLLM does:
        # the openai SDK's stream helper waits for that event.
        yield event("response.completed", {"response": _finished(head, items, finish, usage).model_dump()})


class OutputItems:
    """A sample's text as the response's output items, built as it comes: content goes to a message item,
    each tool call (read by the request's extractor) to a function_call item. Each step returns the stream's
    events; `items` is the plain answer. The message is there whenever there is text, or no call at all."""

    def __init__(self, extractor: CallExtractor | None) -> None:
        self.extractor = extractor
        self.items: list[OutputMessage | OutputFunctionCall] = []
        self.calls: dict[int, int] = {}  # the extractor's call index -> its item's output index
        self.writing = False  # the last item is still open

    def start(self) -> list[Event]:
        """Without tool calling the answer is one message: it opens before the first token, as OpenAI's does."""
        return self._open_message() if self.extractor is None else []

    def feed(self, text: str, finish: str | None) -> list[Event]:
        calls = []
        if self.extractor is not None:
            text, calls = self.extractor.feed(text, final=finish is not None)
        events = []
        if text:
            if not (self.writing and isinstance(self.items[-1], OutputMessage)):
                events += self._close("completed") + self._open_message()
            self.items[-1].content[0].text += text
            events.append(("response.output_text.delta", {**self._where(), "delta": text, "logprobs": []}))
        for d in calls:
            if d.id is not None:
                call = OutputFunctionCall(
                    id=f"fc_{uuid.uuid4().hex}", call_id=d.id, name=d.name, arguments="", status="in_progress"
                )
                events += self._close("completed") + self._open(call)
                self.calls[d.index] = len(self.items) - 1
            if d.arguments:
                index = self.calls[d.index]
                call = self.items[index]
                call.arguments += d.arguments
                where = {"item_id": call.id, "output_index": index}
                events.append(("response.function_call_arguments.delta", {**where, "delta": d.arguments}))
        if finish is not None:
            if not self.items:
                events += self._open_message()
            events += self._close("incomplete" if finish == "length" else "completed")
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1, "content_index": 0}

    def _open(self, item: OutputMessage | OutputFunctionCall) -> list[Event]:
        self.items.append(item)
        self.writing = True
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": item.model_dump()})]

    def _open_message(self) -> list[Event]:
        events = self._open(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[]))
        part = OutputText(text="")
        self.items[-1].content.append(part)
        return [*events, ("response.content_part.added", {**self._where(), "part": part.model_dump()})]

    def _close(self, status: str) -> list[Event]:
        if not self.writing:
            return []
        self.writing = False
        item = self.items[-1]
        item.status = status
        index = len(self.items) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [
                ("response.output_text.done", {**self._where(), "text": part.text, "logprobs": []}),
                ("response.content_part.done", {**self._where(), "part": part.model_dump()}),
            ]
        else:
            done = {"item_id": item.id, "output_index": index, "name": item.name, "arguments": item.arguments}
            events = [("response.function_call_arguments.done", done)]
        return [*events, ("response.output_item.done", {"output_index": index, "item": item.model_dump()})]


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _messages(req: ResponsesRequest) -> list[ChatMessageParam]:
    """`instructions` as the system message, then the input's items as chat messages: a function_call joins
    the assistant turn before it (an earlier response's message and calls are one turn), its output is a
    tool message."""
    messages = [] if req.instructions is None else [ChatMessageParam(role="system", content=req.instructions)]
    if isinstance(req.input, str):
        return [*messages, ChatMessageParam(role="user", content=req.input)]
    for item in req.input:
        if item.type == "function_call":
            call = ChatCompletionMessageToolCallParam(
                id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments)
            )
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessageParam(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            messages.append(ChatMessageParam(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
        else:
            messages.append(ChatMessageParam(role=item.role, content=_text(item.content)))
    return messages


def _finished(head: ResponseObject, items: OutputItems, finish: str | None, usage: UsageInfo) -> ResponseObject:
    cut = finish == "length"
    return head.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "output": [item.model_copy(deep=True) for item in items.items],
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            ),
        }
    )
