"""The messages between the API process (`AsyncLLM`) and the engine process (`engine_core`), over two pipes:

  to the engine    AddRequest, AbortRequest, AddLoRA, RemoveLoRA, Shutdown
  from the engine  Ready once the model is loaded; Added, the answer to each AddRequest and AddLoRA (None or
                   the rejection); StepOutputs once a step (and after an abort that leaves the engine idle);
                   EngineDead when the engine failed (the process exits after it)

A step's outputs are deltas: each request that advanced sends only its new text, tokens and logprobs
(`RequestDelta`, made straight from the engine's request, never a RequestOutput). They cross the pipe at
every step, for every running request, so they are typed tuples (`Row`): named fields to read, plain tuples
to pickle (StepOutputs sends them as such). A dataclass per delta pickles 3-4 times slower: at 256 sequences,
~0.4 ms more a step on the engine's side, against ~0.05 ms for these."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from heron.logprobs import RawLogprobs
from heron.lora_request import LoRARequest
from heron.pooling_params import PoolingParams
from heron.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from heron.stats import EngineStats


class Row(tuple):
    """A tuple whose items have names (`item(i)`); built from a tuple of all of them, in order."""

    __slots__ = ()


def item(index: int) -> Any:
    return property(itemgetter(index))


# -- to the engine -------------------------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    # The API process tokenizes a text prompt: None only when it has no tokenizer (the engine then rejects
    # a text prompt).
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling engine's request (params are then not read)


@dataclass
class AbortRequest:
    request_id: str  # the engine may not know it (yet, or any more): then a no-op


@dataclass
class AddLoRA:
    """Read and check a LoRA adapter into the engine's host cache (a server loading one at runtime); answered
    with Added under `request_id`."""

    request_id: str
    lora_request: LoRARequest


@dataclass
class RemoveLoRA:
    lora_int_id: int  # requests already queued with it still run (it is read again if they need it)


@dataclass
class Shutdown:
    pass


# -- from the engine -----------------------------------------------------------------------------------------


@dataclass
class ServingInfo:
    """What the API process needs to know of the engine."""

    model_name: str
    max_model_len: int
    tokenizer: object  # a transformers tokenizer (picklable), or None
    generation_defaults: dict
    vocab_size: int  # the model's (token ids and logit_bias keys must be below it)
    max_num_seqs: int  # a request's n samples must fit in one batch
    runner: str = "generate"  # "pooling": the engine takes embedding requests only
    num_gpu_blocks: int = 0  # the KV cache's size in blocks (what a data-parallel router remembers per replica)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # a request's logprobs and prompt_logprobs are at most this


@dataclass
class Ready:
    info: ServingInfo


@dataclass
class Added:
    request_id: str
    rejection: tuple[str, str] | None  # (exception type name, message); the message starts with the field


class CompletionDelta(Row):
    """One sequence's news since its previous delta (OutputProcessor.news makes its tuple)."""

    __slots__ = ()
    index: int = item(0)
    text: str = item(1)
    token_ids: list[int] = item(2)
    cumulative_logprob: float | None = item(3)
    logprobs: list[RawLogprobs] | None = item(4)
    finish_reason: str | None = item(5)
    stop_reason: int | str | None = item(6)


class RequestDelta(Row):
    """A request's news since its previous delta, with one CompletionDelta tuple per sequence. The prompt and
    its ids are never sent: the API process made them."""

    __slots__ = ()
    request_id: str = item(0)
    finished: bool = item(1)
    # arrival, first scheduled, first token, last token, finished (RequestMetrics' fields, in order)
    times: tuple[float, float | None, float | None, float | None, float | None] = item(2)
    completions: list[tuple] = item(3)  # CompletionDelta's items; read them through CompletionDelta(c)
    first: bool = item(4)  # the request's first delta, the only one with the next two
    prompt_logprobs: list[RawLogprobs | None] | None = item(5)
    num_cached_tokens: int = item(6)
    embedding: list[float] | None = item(7)  # a pooling request's vector, in its final delta


@dataclass
class StepOutputs:
    deltas: list[RequestDelta]
    stats: EngineStats  # after the step

    def __reduce__(self) -> tuple:
        return _step_outputs, ([tuple(d) for d in self.deltas], self.stats)


def _step_outputs(rows: list[tuple], stats: EngineStats) -> StepOutputs:
    return StepOutputs(list(map(RequestDelta, rows)), stats)


@dataclass
class EngineDead:
    reason: str
