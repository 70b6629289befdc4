"""The wire format of POST /v1/embeddings: OpenAI's request (and vLLM's extras to it) and response. Fields Heron
does not take are refused (field_policy.py)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from heron.entrypoints.openai.protocol import IgnoredFields, OpenAIBaseModel, TokenId, UsageInfo, integer
from heron.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN

_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(IgnoredFields):
    """OpenAI's fields (`user` among the ignored ones, as on every endpoint) and vLLM's extras."""

    model: str | None = Field(None, description="A served model name; the first one if omitted.")
    input: (
        _Text
        | Annotated[list[_Text], Field(min_length=1)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1)]
    ) = Field(description="A text, texts, token ids, or lists of token ids: one embedding each.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding's float32 values, little-endian, base64-encoded."
    )
    dimensions: integer(1, INT32_MAX) | None = Field(
        None, description="The first d values of each embedding: only for a model trained for it (matryoshka)."
    )
    # vLLM's extras.
    truncate_prompt_tokens: integer(-1, INT32_MAX) | None = Field(
        None, description="Keep only each input's last k tokens (-1: max_model_len of them); unset: too long is a 400."
    )
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) to text inputs.")
    normalize: bool | None = Field(None, description="L2-normalise (default: the server's --pooler-config, true).")
    priority: integer(INT64_MIN, INT64_MAX) = Field(
        0, description="Lower runs first under --scheduling-policy priority; not 0 is a 400 under fcfs."
    )


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
