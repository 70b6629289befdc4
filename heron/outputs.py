"""What `LLM.generate` and the async engine hand back: vLLM's `RequestOutput` shape."""

from __future__ import annotations

from dataclasses import dataclass

from heron.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, as vLLM's: `tokens` are the prompt's and the beam's, `text` their
    decoding; `cum_logprob` the sum of the beam's token logprobs."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first (by length-penalised score)."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    """A pooling model's vector for one prompt, as vLLM's: `embedding` (pooled, then cut to `dimensions` and
    normalised as its PoolingParams say)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's name and fields)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
