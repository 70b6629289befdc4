"""The wire format: pydantic models of OpenAI's requests and responses, field for field, plus the sampling
extras vLLM accepts (top_k, min_p, ...).

Request bodies are strict: `true` is not a token id, `"yes"` not a boolean, NaN and Infinity not numbers,
and text must be valid Unicode (JSON may carry a lone UTF-16 surrogate, which no tokenizer can encode).
Every numeric field states its range here, taken from `heron.sampling_params.RANGES` where SamplingParams
checks the same field; limits that depend on the model or the server's flags (max_model_len, the
vocabulary, --max-seqs-per-request) are checked by the serving code and written into /openapi.json by
`limits.RequestLimits.annotate`.

Length: one model per wire type of completions, chat, tokenization and models, which share their field types
and sampling fields; the Responses and embeddings APIs have their own modules."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from heron.sampling_params import INT64_MAX, INT64_MIN, LOGIT_BIAS, RANGES, TOKEN_ID

MAX_STOP = 64  # stop strings per request: each is searched for in every new piece of text
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 256  # entries: the sampler builds each one per step in Python


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(low: int, high: int) -> Any:
    """An integer in [low, high], also when JSON writes it 4.0 (JSON Schema's integers include those, and so
    does vLLM), but never a bool or a string. (The range sits inside the type, so that `integer(...) | None`
    states it in the JSON schema.)"""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]


def ranged(name: str) -> Any:
    """The type of SamplingParams' field `name`, with its range."""
    r = RANGES[name]
    if r.integer:
        return integer(r.low, r.high)
    return Annotated[float, Field(**{"gt" if r.low_open else "ge": r.low, "le": r.high})]


TokenId = integer(TOKEN_ID.low, TOKEN_ID.high)


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-style clients send ones we have no use for.
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body, or part of one. Strict, so that its checks hold whatever JSON says; a field it does not
    declare is refused (field_policy.py says why), except as null, which asks for nothing."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None and k not in cls.model_fields for k, v in data.items()):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        # pydantic refuses a lone surrogate by itself only in text it must measure or match (min_length,
        # pattern): the same error here for all the rest.
        if not _valid_unicode(value):
            raise PydanticCustomError("string_unicode", "Input should be valid Unicode text")
        return value


def _valid_unicode(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    elif isinstance(value, list) and value and isinstance(value[0], str | list):  # not a list of token ids
        return all(map(_valid_unicode, value))
    elif isinstance(value, dict):
        return all(map(_valid_unicode, value))
    return True


# -- errors ------------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- shared pieces -----------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Every chunk carries the usage so far (vLLM's extra).")


class IgnoredFields(RequestModel):
    """OpenAI's fields that change nothing a self-hosted server computes: accepted and ignored (docs/server.md).
    `store` is refused when true, as nothing is kept."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
LogitBiasKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")]
LogitBiasValue = Annotated[float, Field(ge=LOGIT_BIAS.low, le=LOGIT_BIAS.high)]


class JsonSchemaFormat(RequestModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` extra: exactly one constraint (heron.sampling_params.StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(IgnoredFields):
    """Fields that completions and chat share. Unset temperature / top_p / top_k / repetition_penalty fall
    back to the model's generation_config, then to `SamplingParams`' defaults."""

    model: str | None = Field(None, description="A served model name; the first one if omitted.")
    n: ranged("n") = Field(1, description="Samples per prompt; prompts x n at most --max-seqs-per-request.")
    frequency_penalty: ranged("frequency_penalty") = 0.0
    presence_penalty: ranged("presence_penalty") = 0.0
    logit_bias: dict[LogitBiasKey, LogitBiasValue] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> bias in [-100, 100]."
    )
    seed: ranged("seed") | None = None
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: ranged("temperature") | None = None
    top_p: ranged("top_p") | None = None
    # Extras beyond OpenAI's schema, named as in vLLM.
    top_k: ranged("top_k") | None = Field(None, description="Sample from the k most likely tokens; -1 or 0: all.")
    min_p: ranged("min_p") = 0.0
    repetition_penalty: ranged("repetition_penalty") | None = None
    min_tokens: ranged("min_tokens") = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="Draw only these tokens (their logprobs stay the unrestricted ones)."
    )
    bad_words: list[StopString] | None = Field(None, max_length=MAX_STOP, description="Words never to write.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: integer(INT64_MIN, INT64_MAX) = Field(
        0, description="Lower runs first under --scheduling-policy priority; not 0 is a 400 under fcfs."
    )
    best_of: ranged("n") | None = Field(
        None, description="Candidates per prompt, of which the n with the highest cumulative logprob are returned."
    )
    prompt_logprobs: ranged("prompt_logprobs") | None = Field(
        None, description="Logprobs of each prompt token and of its k most likely alternatives (not with stream)."
    )
    # Structured outputs (at most one constraint): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    use_beam_search: bool = Field(False, description="Beam search of width n, as transformers' num_beams.")
    length_penalty: Annotated[float, Field(ge=-10.0, le=10.0)] = 1.0
    early_stopping: bool | Literal["never"] = False


# -- /v1/completions ---------------------------------------------------------------------------------------


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: (
        Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: ranged("max_tokens") | None = 16
    echo: bool = False
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) to text prompts.")
    logprobs: ranged("logprobs") | None = None
    # Validated as text so that its refusal can say why (serving_completion); the schema admits only null.
    suffix: Annotated[str | None, WithJsonSchema({"type": "null", "description": "Not supported."})] = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob: one token of a prompt position (keyed by its id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None  # always set, except on stream chunks


# -- /v1/chat/completions ----------------------------------------------------------------------------------


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCallParam(RequestModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ChatCompletionMessageToolCallParam(RequestModel):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatCompletionMessageToolCallParam] | None = None  # on assistant messages
    tool_call_id: str | None = None  # on tool messages: the call this is the result of


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = None


class ChatCompletionToolParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class ChatCompletionNamedToolChoiceParam(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(RequestModel):
    """How messages become a prompt, as vLLM's chat requests and /tokenize take them."""

    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opening.")
    continue_final_message: bool = Field(
        False, description="Leave the last message open, for the model to continue it (not with add_generation_prompt)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables of the chat template, e.g. Qwen3's enable_thinking."
    )


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = Field(
        None, description='Default: "auto" with tools (needs --enable-auto-tool-choice), else "none".'
    )
    parallel_tool_calls: bool = True
    echo: bool = Field(False, description="Begin the answer with the last message's content if it is the assistant's.")
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens to the rendered template.")
    max_tokens: ranged("max_tokens") | None = Field(
        None, description="Deprecated by OpenAI in favour of max_completion_tokens."
    )
    max_completion_tokens: ranged("max_tokens") | None = None
    logprobs: bool = False
    top_logprobs: ranged("logprobs") | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"  # --response-role's
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaModel(OpenAIBaseModel):
    @model_serializer(mode="wrap")
    def _omit_unset(self, handler) -> dict:
        # OpenAI's deltas carry only what changed: the role once, then content; the last one is `{}`.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(DeltaModel):
    """A piece of a call: the first has its id, type and name (and arguments ""), the rest argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(DeltaModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer, version ----------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "heron"
    root: str | None = Field(None, description="The model served under this name: its folder or hub id (vLLM's).")
    parent: str | None = Field(None, description="A LoRA adapter's base model (vLLM's); None for a base model.")
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(ChatTemplateFields):
    """Either a prompt, or chat messages to render with the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="Also return each token as the tokenizer spells it.")


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


def _field_names(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields).union(*(_field_names(m) for m in model.__subclasses__()))


def request_fields() -> frozenset[str]:
    """Every field of every request body, of the request models defined so far (protocol_responses.py's
    too once imported)."""
    return frozenset(_field_names(RequestModel))
