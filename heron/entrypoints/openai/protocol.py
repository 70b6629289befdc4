"""The wire format: pydantic models of OpenAI's requests and responses, field for field, plus the sampling
extras vLLM accepts (top_k, min_p, ...).

Request bodies are strict: `true` is not a token id, `"yes"` not a boolean, NaN and Infinity not numbers,
and text must be valid Unicode (JSON may carry a lone UTF-16 surrogate, which no tokenizer can encode).
Every numeric field states its range here, taken from `heron.sampling_params.RANGES` where SamplingParams
checks the same field; limits that depend on the model or the server's flags (max_model_len, the
vocabulary, --max-seqs-per-request) are checked by the serving code and written into /openapi.json by
`limits.RequestLimits.annotate`."""

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
    """A request body, or part of one. Strict, so that its checks hold whatever JSON says."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
LogitBiasKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")]
LogitBiasValue = Annotated[float, Field(ge=LOGIT_BIAS.low, le=LOGIT_BIAS.high)]


class SamplingRequest(RequestModel):
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
    user: str | None = None
    # Extras beyond OpenAI's schema, named as in vLLM.
    top_k: ranged("top_k") | None = Field(None, description="Sample from the k most likely tokens; -1 or 0: all.")
    min_p: ranged("min_p") = 0.0
    repetition_penalty: ranged("repetition_penalty") | None = None
    min_tokens: ranged("min_tokens") = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: integer(INT64_MIN, INT64_MAX) = Field(
        0, description="Lower runs first under --scheduling-policy priority."
    )
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
    logprobs: ranged("logprobs") | None = None
    # Validated as text so that its refusal can say why (serving_completion); the schema admits only null.
    suffix: Annotated[str | None, WithJsonSchema({"type": "null", "description": "Not supported."})] = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length"] | None = None


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


class ChatMessageParam(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: ranged("max_tokens") | None = Field(
        None, description="Deprecated by OpenAI in favour of max_completion_tokens."
    )
    max_completion_tokens: ranged("max_tokens") | None = None
    logprobs: bool = False
    top_logprobs: ranged("logprobs") | None = None


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


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
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler) -> dict:
        # OpenAI's deltas carry only what changed: the role once, then content; the last one is `{}`.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


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
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either a prompt, or chat messages to render with the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


def _field_names(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields).union(*(_field_names(m) for m in model.__subclasses__()))


REQUEST_FIELDS = frozenset(_field_names(RequestModel))  # every field of every request body
