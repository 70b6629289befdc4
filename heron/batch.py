"""What the scheduler hands the model runner each step, and what the runner hands back: plain data (ids,
counts, token and block lists, sampling constants), never a live request or sequence, so that the executor
knows nothing of the engine's objects (vLLM v1's boundary).

A step may read tokens that are not on the host yet: the engine launches step t before step t - 1's
sampled tokens are read back (LLMEngine.advance). Such a token is simply absent from the host's lists: a
sequence's `token_ids` are the tokens known on the host, and an input position past them is the previous
step's sample for that sequence, which the runner takes on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from heron.logprobs import RawLogprobs
from heron.lora_request import LoRARequest
from heron.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """What the sampler reads of one sequence, fixed for its life; made once, so that a step reads two
    tuples per sampled row and nothing of the request."""

    floats: tuple[float, float, float]  # temperature (0: greedy), top_p, min_p
    ints: tuple[int, int, int, int]  # top_k, seed, logprobs (-1: none), sample index (which of the n)
    num_prompt_tokens: int
    params: SamplingParams  # the rarer inputs: penalties, logit_bias, token restrictions, min_tokens, prompt_logprobs
    has_extras: bool  # penalties, logit_bias, allowed_token_ids, bad_words or min_tokens: built per row in Python

    @classmethod
    def of(cls, params: SamplingParams, seed: int, index: int, num_prompt_tokens: int) -> SamplingSpec:
        p = params
        return cls(
            floats=(0.0 if p.greedy else p.temperature, p.top_p, p.min_p),
            ints=(p.top_k, seed, -1 if p.logprobs is None else p.logprobs, index),
            num_prompt_tokens=num_prompt_tokens,
            params=p,
            has_extras=p.has_penalties
            or bool(p.logit_bias)
            or bool(p.allowed_token_ids)
            or bool(p.bad_words_token_ids)
            or p.min_tokens > 0,
        )

    @property
    def index(self) -> int:
        return self.ints[3]

    def for_row(self, j: int) -> SamplingSpec:
        """Row j of a draw that forks into n sequences: the same request's sample index + j."""
        return self if j == 0 else replace(self, ints=(*self.ints[:3], self.index + j))


@dataclass
class ScheduledBatch:
    """One step: per scheduled sequence (in the lists' order) what the runner computes and samples, then the
    KV block moves to make before the forward. The scheduler makes these lists anew each step and never
    changes them afterwards, so the runner may hold on to them until the step is read back. The inner token
    lists are the engine's, growing as tokens are read back: the runner reads them only while it launches
    the step."""

    seq_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed this step
    num_computed: list[int] = field(default_factory=list)  # tokens cached before it: its first position
    num_samples: list[int] = field(default_factory=list)  # tokens drawn: 0 (mid-prompt), 1, or n (it forks)
    token_ids: list[list[int]] = field(default_factory=list)  # tokens known on the host: prompt, then output
    # The block manager's lists. One only grows in place from step to step, and any other change gives the
    # sequence a new list: the runner keeps the lists it has seen and copies only their new entries.
    block_tables: list[list[int]] = field(default_factory=list)
    sampling: list[SamplingSpec] = field(default_factory=list)
    prompt_logprobs: list[int] = field(default_factory=list)  # sequences scoring the prompt tokens they compute
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # With LoRA only (empty otherwise): each sequence's adapter slot (-1: the base model), and the adapters to
    # load into their slots before the forward.
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass
class ModelRunnerOutput:
    """A step's results, per scheduled sequence in the batch's order."""

    sampled: list[list[int]]  # its new tokens (num_samples of them), or []
    logprobs: list[list[RawLogprobs]]  # parallel to `sampled` (empty if not asked)
    prompt_logprobs: list[list[RawLogprobs]]  # for the prompt positions computed this step
    # A pooling model's step (executor/pooler.py): per sequence its pooled float32 vector (a CPU tensor) if the
    # step finished its prompt, else None; None for a generation step.
    pooled: list | None = None
