"""A step launched on the device: the inputs it was prepared with, and the read-back of its sampled tokens
(the step's one host-device sync), sorted by sequence into a ModelRunnerOutput."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from heron.attention import AttentionMetadata
from heron.batch import ModelRunnerOutput, SamplingSpec, ScheduledBatch
from heron.executor.graph_keys import GraphKey
from heron.executor.input_buffers import StepArrays
from heron.executor.sampler import SamplerOutput, SamplingTensors
from heron.logprobs import RawLogprobs


@dataclass
class StepInputs:
    """What the runner made of a batch: read when the step is launched, and again when it is read back."""

    batch: ScheduledBatch
    arrays: StepArrays  # the step's input arrays (host and device)
    graph: GraphKey | None  # the captured graph that runs this step, if any
    meta: AttentionMetadata
    seq_of_row: list[int] | range  # per sampled row: its sequence's index in the batch
    row_specs: list[SamplingSpec]  # per sampled row: its sampling constants
    num_samples: list[int]  # per scheduled sequence: the tokens it draws (0, 1, or n when it forks)
    sampling: SamplingTensors
    num_pending: int  # input tokens taken from the previous step's samples on the device
    pending_in_order: bool  # ... input row i from sample row i, for every row (pending_dst/src not filled)
    first_rows: bool  # the logits rows are the first len(rows) rows of the hidden states (no logits_indices)
    one_row_each: bool  # every sequence samples one token, in the batch's order
    prompt_lp_k: int  # -1: no prompt logprobs this step
    prompt_lp_rows: list[tuple[int, int, int]]  # (sequence index, positions scored, k) per sequence scoring

    @property
    def read_back_now(self) -> bool:
        """The next step needs this one's tokens on the host: an n > 1 request forks, or a row has penalties or
        bad words of several tokens."""
        return self.sampling.needs_host_tokens or max(self.num_samples, default=0) > 1


class Forward(NamedTuple):
    """A step whose forward pass is launched and whose tokens are not drawn yet (ModelRunner.sample)."""

    inputs: StepInputs
    logits: torch.Tensor


class InflightStep:
    """A step launched on the device. Its outputs are copied to pinned host memory behind the step's
    kernels; `result()` waits for that copy (the step's one sync) and sorts the tokens by sequence."""

    def __init__(
        self,
        num_seqs: int,
        inputs: StepInputs,
        out: SamplerOutput,
        prompt_lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        tokens_host: torch.Tensor | None,
    ) -> None:
        """`tokens_host`: pinned memory for the sampled tokens, untouched until result() (None: on the CPU)."""
        self.num_seqs, self.inputs = num_seqs, inputs
        to_host = lambda t: None if t is None else t.to("cpu", non_blocking=True)
        tokens = to_host(out.token_ids) if tokens_host is None else tokens_host.copy_(out.token_ids, non_blocking=True)
        self._host = [
            tokens,
            *(to_host(t) for t in (out.logprob_token_ids, out.logprobs, out.ranks, *(prompt_lp or (None,) * 3))),
        ]
        self._done = None
        if out.token_ids.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    @property
    def read_back_now(self) -> bool:
        return self.inputs.read_back_now

    def result(self) -> ModelRunnerOutput:
        if self._done is not None:
            self._done.synchronize()
        token_ids, lp_ids, lps, ranks, prompt_ids, prompt_vals, prompt_ranks = (
            None if t is None else t.tolist() for t in self._host
        )
        inputs, n = self.inputs, self.num_seqs
        none: list[list] = [[]] * n  # (one shared empty list per sequence: read only)
        if inputs.one_row_each and lps is None and prompt_ids is None:  # the common decode step
            return ModelRunnerOutput([[t] for t in token_ids], none, none)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[RawLogprobs]] = [[] for _ in range(n)] if lps is not None else none
        for r, (i, spec) in enumerate(zip(inputs.seq_of_row, inputs.row_specs)):
            sampled[i].append(token_ids[r])
            k = spec.ints[2]
            if lps is not None and k >= 0:
                logprobs[i].append(_position(lp_ids[r], lps[r], ranks[r], k))
        prompt_logprobs: list[list[RawLogprobs]] = none
        if prompt_ids is not None:
            prompt_logprobs = [[] for _ in range(n)]
            r = 0
            for i, count, k in inputs.prompt_lp_rows:
                prompt_logprobs[i] = [
                    _position(prompt_ids[r + j], prompt_vals[r + j], prompt_ranks[r + j], k) for j in range(count)
                ]
                r += count
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)


def _position(ids: list[int], values: list[float], rank: int, k: int) -> RawLogprobs:
    """One position from its row of the sampler's output: the chosen token with its `rank`, then the top k
    ranked 1..k (a chosen token among them keeps its place there, as in vLLM)."""
    return dict(zip(ids[: 1 + k], zip(values[: 1 + k], itertools.chain((rank,), range(1, k + 1)))))
