"""The wire format of OpenAI's Responses API (POST /v1/responses): the request as Heron takes it and the
response object as the openai SDK parses it. Fields Heron does not take are refused (field_policy.py)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from heron.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolParam,
    FunctionDefinition,
    IgnoredFields,
    NamedFunction,
    OpenAIBaseModel,
    RequestModel,
    ranged,
)

Status = Literal["in_progress", "completed", "incomplete"]


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str
    # What an output_text part of an earlier response carries, when a client sends its output back.
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(RequestModel):
    """A message item; an earlier response's output message (with its id and status) is one too."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(RequestModel):
    """A call the model made earlier (an earlier response's output item): the assistant's tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(RequestModel):
    """A call's result, which the client computed: the chat history's tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Status | None = None


def _item_type(item: Any) -> str:
    # A message item may leave its type out (the API's "easy input message").
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function tool, flat as the Responses API writes it (chat nests the same fields under `function`).
    Other tool types (web_search, file_search, mcp, ...) run on OpenAI's side: a 400 naming the type."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError(
                "tool_type",
                "tools of type {kind} are not supported: Heron runs no tools itself, only function tools are "
                "answered (with calls for the client to run).",
                {"kind": repr(data.get("type"))},
            )
        return data

    def chat_tool(self) -> ChatCompletionToolParam:
        fields = self.model_dump(exclude={"type"})
        return ChatCompletionToolParam(function=FunctionDefinition(**fields))


class ToolChoiceFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool = Field(True, description="Accepted; Heron's events carry no obfuscation padding.")


class ResponsesRequest(IgnoredFields):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: ranged("max_tokens") | None = None
    temperature: ranged("temperature") | None = None
    top_p: ranged("top_p") | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    top_logprobs: ranged("logprobs") | None = Field(None, description="Not supported yet: 0 or null only.")
    # Declared (completions' `prompt` is another field) so that its refusal can say why (serving_responses).
    prompt: dict | None = Field(None, description="Not supported: Heron keeps no prompt templates.")
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = Field(
        None, description='Default: "auto" with tools (needs --enable-auto-tool-choice), else "none".'
    )
    parallel_tool_calls: bool = True

    def chat_tools(self) -> tuple[list[ChatCompletionToolParam], str | ChatCompletionNamedToolChoiceParam | None]:
        """The tools and the tool choice in chat's shape, which serving_tools.ToolCalling reads."""
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            choice = ChatCompletionNamedToolChoiceParam(function=NamedFunction(name=choice.name))
        return [t.chat_tool() for t in self.tools or []], choice


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class OutputFunctionCall(OpenAIBaseModel):
    """A call for the client to run; `call_id` ties its function_call_output to it."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Status
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    # The request's, as OpenAI echoes them (tool_choice as it applies: "auto" by default with tools).
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "none"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    usage: ResponseUsage | None = None
