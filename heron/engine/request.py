"""A request and its sequences: the unit the scheduler and the block manager work with.

A request with `n > 1` starts as one sequence and forks into n once its prompt is computed
(parallel_sampling.py).

A sequence's `token_ids` are the tokens known on the host. The engine launches a step before the previous
one's tokens are read back (LLMEngine.advance), so a sequence may also have `num_pending` tokens sampled
on the device and not yet here; they follow `token_ids`, and every length the scheduler reasons with
(`num_tokens`) counts them.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from heron.batch import SamplingSpec
from heron.logprobs import RawLogprobs
from heron.lora_request import LoRARequest
from heron.outputs import RequestMetrics
from heron.pooling_params import PoolingParams
from heron.sampling_params import RequestOutputKind, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids  # prompt followed by the output so far, as known on the host
        self.num_pending = 0  # tokens sampled by launched steps, on the device still: they follow token_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_samples = 1  # tokens its next draw yields: n for a request's first sequence until it forks
        self.sampling = SamplingSpec.of(request.params, request.seed, index, request.num_prompt_tokens)
        self.block_table: list[int] = []  # appended to in place, replaced on any other change
        self.num_dropped_blocks = 0  # leading entries of block_table out of every layer's window, released
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[RawLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_sent_tokens = 0  # output tokens and text characters already in RequestOutputKind.DELTA outputs
        self.num_sent_chars = 0
        self.grammar = None  # structured outputs: its xgrammar GrammarMatcher (engine/structured_output.py)
        self.lora_slot = -1  # its LoRA adapter's device slot while it holds one (lora_slots.py); -1: none

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Its length: the tokens known on the host and those still on the device."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host (not those of a step still running)."""
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.request.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def reached_length_limit(self) -> bool:
        """No token may follow: max_tokens are out (decided without knowing the last token's value, so a
        pending token counts). The engine sets max_tokens so that this also bounds the context."""
        return self.num_tokens >= self.request.length_limit

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def add_pending(self) -> None:
        """A launched step draws this sequence's next token; it stays on the device until read back."""
        self.num_pending += 1

    def append_token(self, token: int) -> None:
        """The oldest pending token, read back."""
        self.token_ids.append(token)
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """The sequence has finished: the draws of steps launched after its last token never come in."""
        self.num_pending = 0

    def update_block_hashes(self, block_size: int, memo: dict[bytes, bytes] | None = None) -> list[bytes]:
        """Extend the chained hashes to every full block of token_ids; a hash names a block's whole prefix
        (sha256 of the parent's hash and the block's tokens as int64). `memo` (the block manager's): hashes by
        that input, so that a prompt's blocks that many requests share (a system prompt) are hashed once."""
        hashes = self.block_hashes
        start, end = len(hashes), len(self.token_ids) // block_size
        if start == end:
            return hashes
        data = np.asarray(self.token_ids[start * block_size : end * block_size], dtype=np.int64).tobytes()
        step = 8 * block_size
        h = hashes[-1] if hashes else self.request.cache_salt
        for i in range(0, len(data), step):
            key = h + data[i : i + step]
            h = None if memo is None else memo.get(key)
            if h is None:
                h = hashlib.sha256(key).digest()
                if memo is not None:
                    memo[key] = h
            hashes.append(h)
        return hashes


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    seed: int = 0  # the sampler's seed: params.seed, or drawn from the engine's generator
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[RawLogprobs | None] | None = None
    aborted: bool = False
    sent_prompt: bool = False  # a RequestOutputKind.DELTA output carried the prompt fields already
    # A beam search's state, beam_search.BeamSearch (not named here: that module imports this one); while it
    # runs, `seqs` are the live beams.
    beam: object | None = None
    lora_request: LoRARequest | None = None
    # A pooling model's request (prefill only): its parameters, and its vector once pooled.
    pooling_params: PoolingParams | None = None
    embedding: list[float] | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs.append(Sequence(self, 0, list(self.prompt_token_ids)))
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def cache_salt(self) -> bytes:
        """The start of its blocks' hash chain: a LoRA adapter's K/V differ from the base model's, so each
        adapter has a prefix cache of its own."""
        return b"" if self.lora_request is None else b"lora:%d" % self.lora_request.lora_int_id

    @functools.cached_property
    def length_limit(self) -> int:
        """Prompt plus max_tokens (the engine has checked that this fits in max_model_len)."""
        return self.num_prompt_tokens + self.params.max_tokens

    @functools.cached_property
    def detokenizes_each_token(self) -> bool:
        """Text token by token is needed for streaming and for stop strings; a request that only wants its
        final output and has no stop strings is decoded once, when it finishes."""
        return self.params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(self.params.stop)

    @property
    def is_finished(self) -> bool:
        """Asked of every request that advanced, at least twice a step: a plain loop, about twice as fast
        as all() over a generator."""
        if not self.aborted and len(self.seqs) != self.params.n:
            return False
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
