"""Continuous batching: every step decides which sequences run and how many of their tokens.

There is no separate prefill phase: a sequence simply has tokens whose K/V are not yet cached (the whole
prompt at first, one sampled token later), and each step gives each running sequence as many of those
as the token budget allows. A long prompt is thereby chunked across steps and mixed with decodes.
When blocks run out the lowest-ranked running sequence is preempted (recomputed later, or swapped to
host memory when `swap_space` is set). Pure Python over integers: no torch here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from heron.config import SchedulerConfig
from heron.engine.block_manager import BlockManager
from heron.engine.request import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens computed this step, per sequence
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # kept in rank order
        self.running: list[Sequence] = []  # admission order (fcfs) or rank order (priority)
        self.swapped: list[Sequence] = []
        self.unforked: set[Sequence] = set()  # first sequences of n > 1 requests that have not forked yet
        self.num_preemptions = 0

    # -- ranking -------------------------------------------------------------------------------------

    def _rank(self, seq: Sequence) -> tuple:
        r = seq.request
        return (r.priority, r.arrival_time) if self.config.policy == "priority" else (r.arrival_time,)

    def _insert_waiting(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SequenceStatus.WAITING
        if front and self.config.policy == "fcfs":
            self.waiting.insert(0, seq)
        else:
            keys = [self._rank(s) for s in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._rank(seq)), seq)

    # -- requests coming and going ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.params.n > 1:
            self.unforked.add(seq)
        self._insert_waiting(seq)

    def _free_seats(self) -> int:
        """max_num_seqs less the running sequences' seats: one each, but all n for a request that has
        not forked yet."""
        held = sum(s.num_samples - 1 for s in self.unforked if s.status is SequenceStatus.RUNNING)
        return self.config.max_num_seqs - len(self.running) - held

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted): its blocks are released at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.bm.free_seq(seq)
        self.bm.free_swapped(seq)
        self.unforked.discard(seq)
        seq.status = SequenceStatus.FINISHED

    # -- the step ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._preempt_for_waiting(batch)
            self.running.sort(key=self._rank)

        # 1. Running sequences, in rank order; the lowest-ranked make room when blocks run out.
        preempted_before = batch.num_preempted
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.reached_length_limit:
                i += 1  # its last token is still being sampled and ends it (see LLMEngine.step)
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while (copies := self.bm.allocate(seq, n)) is None:
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; self.running shrank
            batch.block_copies += copies
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1

        if batch.num_preempted > preempted_before:
            return batch  # no admissions in a step that ran out of blocks: they would be undone next step
        # A request that has not forked yet takes the seats of all its n samples up front.
        seats = self._free_seats()

        # 2. Swapped-out sequences come back before new ones.
        while self.swapped and budget > 0 and seats >= self.swapped[0].num_samples:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.bm.can_swap_in(seq, n):
                break
            self.swapped.pop(0)
            batch.swap_in += self.bm.swap_in(seq)
            batch.block_copies += self.bm.allocate(seq, n)
            self._admit(seq, n, batch)
            seats -= seq.num_samples
            budget -= n

        # 3. Waiting sequences, new or preempted, with whatever the prefix cache already holds.
        while self.waiting and budget > 0 and not self.swapped and seats >= self.waiting[0].num_samples:
            seq = self.waiting[0]
            cached = self.bm.find_cached(seq)
            n = min(seq.num_uncomputed_tokens - len(cached) * self.bm.block_size, budget)
            copies = self.bm.allocate(seq, n, cached)
            if copies is None:
                break
            if seq.request.metrics.first_scheduled_time is None:
                self.bm.count_query(seq.num_prompt_tokens)
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.pop(0)
            batch.block_copies += copies
            self._admit(seq, n, batch)
            seats -= seq.num_samples
            budget -= n
        return batch

    def _admit(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.bm.cpu_free and self.bm.can_swap_out(seq):
            batch.swap_out += self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free_seq(seq)
            self._insert_waiting(seq, front=True)

    def _preempt_for_waiting(self, batch: ScheduledBatch) -> None:
        """Priority policy: a waiting request ranked above a running one takes its place when the batch
        is full (seats or blocks)."""
        while self.waiting and self.running:
            best, worst = self.waiting[0], max(self.running, key=self._rank)
            if self._rank(best) >= self._rank(worst):
                return
            seats = self._free_seats()
            need = self.bm.blocks_needed(min(best.num_uncomputed_tokens, self.config.max_num_batched_tokens))
            if seats >= best.num_samples and need <= self.bm.num_free_blocks:
                return
            self._preempt(worst, batch)

    # -- after the step ---------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch) -> None:
        """The step ran: its tokens' K/V are now cached."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq, before)

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Branch off the other n - 1 samples of a request whose prompt is done; they share its blocks."""
        children = []
        self.unforked.discard(seq)
        for index in range(1, seq.params.n):
            child = seq.fork(index)
            self.bm.fork(seq, child)
            seq.request.seqs.append(child)
            self.running.append(child)
            children.append(child)
        return children
