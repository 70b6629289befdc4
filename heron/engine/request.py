"""A request and its sequences: the unit the scheduler and the block manager work with.

A request with `n > 1` starts as one sequence; when its prompt has been computed the n samples are drawn
from the same logits and the sequence forks into n, which share the prompt's KV blocks.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from heron.outputs import Logprobs, RequestMetrics
from heron.sampling_params import RequestOutputKind, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()

# Stands in token_ids for a token sampled by a step still running on the GPU (see LLMEngine.step): the
# scheduler already counts it, the model runner reads its value on the device, the output processor
# writes it in when the step's results arrive.
PENDING_TOKEN = -1


class Sequence:
    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids  # prompt followed by the output so far
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_pending = 0  # trailing PENDING_TOKEN entries of token_ids
        self.block_table: list[int] = []  # appended to in place, replaced on any other change
        self.cpu_block_table: list[int] = []  # while swapped out
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[Logprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_sent_tokens = 0  # output tokens and text characters already in RequestOutputKind.DELTA outputs
        self.num_sent_chars = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host (not those of a step still running)."""
        return self.token_ids[self.request.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def reached_length_limit(self) -> bool:
        """No token may follow: max_tokens are out (decided without knowing the last token's value, so a
        pending token counts). The engine sets max_tokens so that this also bounds the context."""
        return len(self.token_ids) >= self.request.length_limit

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_samples(self) -> int:
        """Tokens the sequence's next draw yields: all n of its request for a first sample that has not
        forked yet (it then branches into n sequences), else one. Also the batch slots it takes."""
        if self.index == 0 and self.num_output_tokens == 0:
            return self.request.params.n - len(self.request.seqs) + 1
        return 1

    def update_block_hashes(self, block_size: int) -> list[bytes]:
        """Extend the chained hashes to every full block of known token_ids; a hash names a block's whole
        prefix."""
        known = len(self.token_ids) - self.num_pending
        for i in range(len(self.block_hashes), known // block_size):
            parent = self.block_hashes[i - 1] if i else b""
            chunk = np.asarray(self.token_ids[i * block_size : (i + 1) * block_size], dtype=np.int64)
            self.block_hashes.append(hashlib.sha256(parent + chunk.tobytes()).digest())
        return self.block_hashes

    def fork(self, index: int) -> Sequence:
        """A sibling at the same point (called when the prompt is done, before any output token)."""
        child = Sequence(self.request, index, list(self.token_ids))
        child.num_computed_tokens = self.num_computed_tokens
        child.num_pending = self.num_pending
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        return child


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
    prompt_logprobs: list[Logprobs | None] | None = None
    aborted: bool = False
    sent_prompt: bool = False  # a RequestOutputKind.DELTA output carried the prompt fields already
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
    def length_limit(self) -> int:
        """Prompt plus max_tokens (the engine has checked that this fits in max_model_len)."""
        return self.num_prompt_tokens + self.params.max_tokens

    @functools.cached_property
    def detokenizes_each_token(self) -> bool:
        """Text token by token is needed for streaming and for stop strings; a request that only wants its
        final output and has no stop strings is decoded once, when it finishes."""
        return self.params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(self.params.stop)

    @functools.cached_property
    def sampling_floats(self) -> tuple[float, float, float]:
        """(temperature, 0 when greedy; top_p; min_p): read by the sampler for every sampled row of every
        step, so made once."""
        p = self.params
        return (0.0 if p.greedy else p.temperature, p.top_p, p.min_p)

    @functools.cached_property
    def sampling_ints(self) -> tuple[int, int, int]:
        """(top_k, seed, logprobs or -1)."""
        p = self.params
        return (p.top_k, self.seed, -1 if p.logprobs is None else p.logprobs)

    @functools.cached_property
    def has_sampling_extras(self) -> bool:
        """Penalties, logit_bias or min_tokens: the sampler's rarer inputs, built per row in Python."""
        p = self.params
        return p.has_penalties or bool(p.logit_bias) or p.min_tokens > 0

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
