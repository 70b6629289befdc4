"""A chat request's tools: what its `tool_choice` asks of the sampling, and how each choice's text becomes
tool calls, streamed or not.

- "none" (the default without tools): the tools are shown to the template, the answer is text.
- "auto" (the default with tools): the model decides; its text is read by the `--tool-call-parser`, which
  `--enable-auto-tool-choice` must have turned on (as in vLLM; a 400 says so otherwise).
- "required" and a named function: a JSON-schema grammar makes the output a call, so that it always parses
  against the tool's parameters: for a named function the output is its arguments object; for "required"
  an array of one or more {"name", "arguments"} objects (exactly one without parallel_tool_calls)."""

from __future__ import annotations

import json
from typing import Any, Protocol

from heron.engine.structured_output import build_grammar
from heron.entrypoints.openai.errors import ApiError
from heron.entrypoints.openai.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionToolParam
from heron.entrypoints.openai.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolCallDelta
from heron.entrypoints.openai.tool_parsers.base import call_id
from heron.sampling_params import SamplingParams, StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class CallExtractor(Protocol):
    calls_sent: int

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]: ...


class NamedCallExtractor:
    """The output of a named tool choice is the call's arguments: its id and name come first."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls_sent = 0

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self.calls_sent:
            return "", [ToolCallDelta(0, piece)] if piece else []
        self.calls_sent = 1
        return "", [ToolCallDelta(0, piece, id=call_id(), name=self.name)]


class ToolCalling:
    """One request's tool calling (chat's fields, or the Responses API's in chat's shape), checked when built
    (a 400 naming the field)."""

    def __init__(
        self,
        tools: list[ChatCompletionToolParam] | None,
        tool_choice: str | ChatCompletionNamedToolChoiceParam | None,
        parallel_tool_calls: bool,
        auto_parser: str | None,
    ) -> None:
        tools = tools or []
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise ApiError(400, "tool_choice needs tools.", param="tool_choice")
        by_name = {t.function.name: t for t in tools}
        if len(by_name) < len(tools):
            raise ApiError(400, "Two tools have the same name.", param="tools")
        self.tools = [t.model_dump(exclude_none=True) for t in tools] or None  # for the chat template
        self.choice = choice
        self.named: str | None = None
        self.structured_outputs: StructuredOutputsParams | None = None
        self.parser = None
        if choice == "auto":
            if auto_parser is None:
                raise ApiError(
                    400,
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                    param="tool_choice",
                )
            self.parser = TOOL_PARSERS[auto_parser]()
        elif choice == "required":
            self.structured_outputs = StructuredOutputsParams(json=_calls_schema(tools, parallel_tool_calls))
        elif choice != "none":
            self.named = choice.function.name
            if self.named not in by_name:
                raise ApiError(400, f"tool_choice names the tool {self.named!r}, not in tools.", param="tool_choice")
            self.structured_outputs = StructuredOutputsParams(json=_parameters(by_name[self.named]))

        if self.structured_outputs is not None:
            try:  # here, so that a tool's invalid parameters schema is a 400 and never reaches the engine
                build_grammar(self.structured_outputs)
            except ValueError as e:
                raise ApiError(
                    400, f"A tool's parameters are not a usable JSON schema: {str(e).split(': ', 1)[-1]}", param="tools"
                ) from None

    def apply(self, params: SamplingParams) -> None:
        """Put the tool choice's needs on the request's sampling: its grammar (a 400 if the request has an
        output constraint already), and the special tokens its parser reads (Mistral's [TOOL_CALLS])."""
        if self.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise ApiError(
                    400, f"tool_choice {self.choice!r} takes no other output constraint.", param="tool_choice"
                )
            params.structured_outputs = self.structured_outputs
        params.skip_special_tokens = params.skip_special_tokens and self.skip_special_tokens

    @property
    def skip_special_tokens(self) -> bool:
        """False where the parser's start marker is a special token (Mistral's [TOOL_CALLS])."""
        return self.parser is None or self.parser.skip_special_tokens

    def extractor(self) -> CallExtractor | None:
        """A choice's reader of its text as it comes (None: the text is the answer)."""
        if self.parser is not None:
            return self.parser.streaming()
        if self.named is not None:
            return NamedCallExtractor(self.named)
        if self.choice == "required":
            return JsonArrayToolParser().streaming()
        return None


def _parameters(tool: ChatCompletionToolParam) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def _calls_schema(tools: list[ChatCompletionToolParam], parallel: bool) -> dict[str, Any]:
    call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_tool_calls(calls: list[Any], param: str = "messages") -> list[dict[str, Any]]:
    """An assistant message's earlier calls as chat templates expect them: the arguments as a dict (Qwen's,
    Llama's and Mistral's templates write them with `tojson`). `param`: the field the calls came in."""
    out = []
    for c in calls:
        try:
            arguments = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            raise ApiError(
                400, f"The arguments of tool call {c.id!r} are not JSON: {c.function.arguments!r}", param=param
            ) from None
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}})
    return out
