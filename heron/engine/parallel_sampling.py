"""Parallel sampling (n > 1) with shared prompt blocks.

A request with n > 1 runs as one sequence until its prompt is computed: the step that computes its last
prompt token draws all n first tokens from the same logits (`Sequence.num_samples` rows), and the sequence
then forks into n sequences that share its KV blocks. The block manager copies a shared, partly filled
block before the first write to it (copy-on-write), so the prompt's full blocks stay shared for good.
Until it forks, the sequence holds the batch seats of all n samples, so that they can run together.

The scheduler's side: `add` a request's first sequence, `fork` when its first tokens arrive. Beam search
(beam_search.py) forks the same way, one `branch` at a time.
"""

from __future__ import annotations

from heron.engine.block_manager import BlockManager
from heron.engine.request import Sequence


class ParallelSampling:
    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager

    def add(self, seq: Sequence) -> None:
        """A new request's sequence: with n > 1 its first draw yields n tokens."""
        if seq.params.n > 1:
            seq.num_samples = seq.params.n

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Branch off the other n - 1 samples of `seq`, whose first draw has just been read back (its
        tokens not yet appended): at its point, sharing its blocks. Returns them."""
        seq.num_samples = 1
        children = [self.branch(seq, index) for index in range(1, seq.params.n)]
        seq.request.seqs += children
        return children

    def branch(self, seq: Sequence, index: int) -> Sequence:
        """A copy of `seq` at its point (its pending draw included), sharing its blocks."""
        child = _sibling(seq, index)
        self.bm.fork(seq, child)
        return child


def _sibling(seq: Sequence, index: int) -> Sequence:
    child = Sequence(seq.request, index, list(seq.token_ids))
    child.num_pending = seq.num_pending
    child.num_computed_tokens = seq.num_computed_tokens
    child.block_hashes = list(seq.block_hashes)
    child.status = seq.status
    child.num_cached_tokens = seq.num_cached_tokens
    if seq.grammar is not None:  # at the fork's point, as its blocks
        child.grammar = seq.grammar.fork()
    child.cumulative_logprob = seq.cumulative_logprob
    return child
