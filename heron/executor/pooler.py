"""A pooling model's step output: each finished prompt's final hidden states (after the final norm, where the
LM head would read them) pooled into one vector, LAST, MEAN or CLS, as vLLM's poolers.

A prompt longer than a step's token budget is computed in chunks (the scheduler's chunked prefill), so the
pooler carries what a chunk leaves for the next: MEAN's running sum, CLS's first row. A chunk that ends the
prompt is the one the scheduler gives a draw (`num_samples` > 0); its sequence is pooled then. A sequence
recomputed after a preemption starts again at its first token, and its carried state with it."""

from __future__ import annotations

import torch

from heron.batch import ModelRunnerOutput, ScheduledBatch


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._carried: dict[int, torch.Tensor] = {}  # seq id -> MEAN's float32 sum so far, or CLS's first row

    def __call__(self, hidden: torch.Tensor, batch: ScheduledBatch, qsl: list[int]) -> PooledStep:
        """Pool the step's `hidden` states [T, H] (sequence i's rows from qsl[i] to qsl[i + 1])."""
        finished = [i for i, k in enumerate(batch.num_samples) if k > 0]
        if self.pooling_type == "LAST":
            rows = torch.tensor([qsl[i + 1] - 1 for i in finished], dtype=torch.long, device=hidden.device)
            vectors = hidden.index_select(0, rows).float() if finished else None
            return PooledStep(len(batch), finished, vectors)
        pooled = []
        for i, seq_id in enumerate(batch.seq_ids):
            rows, first = hidden[qsl[i] : qsl[i + 1]], batch.num_computed[i] == 0
            if self.pooling_type == "CLS":
                state = rows[0].float() if first else self._carried.pop(seq_id)
            else:
                state = rows.float().sum(0) if first else self._carried.pop(seq_id) + rows.float().sum(0)
            if batch.num_samples[i] == 0:
                self._carried[seq_id] = state
            elif self.pooling_type == "CLS":
                pooled.append(state)
            else:
                pooled.append(state / (batch.num_computed[i] + batch.num_tokens[i]))
        return PooledStep(len(batch), finished, torch.stack(pooled) if pooled else None)

    def discard(self, seq_id: int) -> None:
        """A sequence aborted mid-prompt: drop what its chunks carried."""
        self._carried.pop(seq_id, None)


class PooledStep:
    """A pooling step on the device: its vectors are copied to the host behind its kernels, and `result()`
    waits for that copy (the step's one sync)."""

    read_back_now = False  # nothing the next step needs: it may be launched first

    def __init__(self, num_seqs: int, finished: list[int], vectors: torch.Tensor | None) -> None:
        self.num_seqs, self.finished = num_seqs, finished
        self._host = None if vectors is None else vectors.to("cpu", non_blocking=True)
        self._done = None
        if vectors is not None and vectors.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> ModelRunnerOutput:
        if self._done is not None:
            self._done.synchronize()
        pooled: list[torch.Tensor | None] = [None] * self.num_seqs
        for j, i in enumerate(self.finished):
            pooled[i] = self._host[j]
        none: list[list] = [[]] * self.num_seqs
        return ModelRunnerOutput(none, none, none, pooled)
