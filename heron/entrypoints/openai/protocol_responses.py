"""The wire format of OpenAI's Responses API (POST /v1/responses): the request as Heron takes it and the
response object as the openai SDK parses it. Fields Heron does not take are refused (field_policy.py)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from heron.entrypoints.openai.protocol import IgnoredFields, OpenAIBaseModel, RequestModel, ranged


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
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputMessage], Field(min_length=1)]
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
    # Chat's tool fields are implemented, so the refusal table cannot hold them; here they are declared so that
    # serving_responses refuses them with its own reason.
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported yet on /v1/responses: use chat.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Not supported yet: none only.")
    parallel_tool_calls: bool | None = Field(None, description="Not supported yet (no tools).")


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


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
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list = Field(default_factory=list)
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    usage: ResponseUsage | None = None
