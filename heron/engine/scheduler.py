"""Continuous batching: every step decides which sequences run and how many of their tokens.

There is no separate prefill phase: a sequence simply has tokens whose K/V are not yet cached (the whole
prompt at first, one sampled token later), and each step gives each running sequence as many of those
as the token budget allows. A long prompt is thereby chunked across steps and mixed with decodes.
When blocks run out the lowest-ranked running sequence is preempted: swapped to host memory when there is
room (swap_space.py), else recomputed later. Requests with n > 1 fork once their prompt is done
(parallel_sampling.py). Pure Python over integers: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.batch import ScheduledBatch
from heron.config import SchedulerConfig
from heron.engine.block_manager import BlockManager
from heron.engine.lora_slots import LoRASlots
from heron.engine.parallel_sampling import ParallelSampling
from heron.engine.request import Sequence, SequenceStatus
from heron.engine.swap_space import SwapSpace
from heron.engine.waiting_queue import WaitingQueue, rank


@dataclass
class SchedulerOutput:
    """A step as the engine sees it: the sequences it runs, in the order of `batch`, the runner's plain
    view of the same step."""

    seqs: list[Sequence] = field(default_factory=list)
    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> list[int]:
        return self.batch.num_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.batch.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, num_cpu_blocks: int = 0, max_loras: int = 0
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Sequence] = []  # admission order (fcfs) or rank order (priority)
        self.swap = SwapSpace(block_manager, num_cpu_blocks)
        self.forks = ParallelSampling(block_manager)
        self.num_preemptions = 0
        self.loras = LoRASlots(max_loras) if max_loras else None  # LoRA adapters' device slots (enable_lora)

    # -- ranking -------------------------------------------------------------------------------------

    def _rank(self, seq: Sequence) -> tuple:
        return rank(seq, self.config.policy)

    # -- requests coming and going ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.forks.add(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)
        self._count_waiting_lora(seq, 1)

    def _free_seats(self) -> int:
        """max_num_seqs less the running sequences' seats: one each, and all n for a request that has not
        forked yet (its `num_samples`)."""
        return self.config.max_num_seqs - sum(s.num_samples for s in self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: waiting, or swapped out."""
        return len(self.waiting) + len(self.swap)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swap.queue)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted): its blocks are released at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)  # (at most max_num_seqs long)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._count_waiting_lora(seq, -1)
        self.swap.discard(seq)
        self.bm.free_seq(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, seq: Sequence) -> list[Sequence]:
        """The other n - 1 samples of `seq`, whose first draw has been read back; they run from now on."""
        children = self.forks.fork(seq)
        for child in children if seq.lora_slot >= 0 else ():
            self.loras.retain(seq.lora_slot)
            child.lora_slot = seq.lora_slot
        self.running += children
        return children

    def branch(self, seq: Sequence, index: int) -> Sequence:
        """A running copy of `seq` sharing its blocks (a beam picked twice: beam_search.py)."""
        child = self.forks.branch(seq, index)
        self.running.append(child)
        return child

    # -- the step ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's sequences and how many tokens of each: running ones first (preempting the lowest
        ranked when blocks run out), then swapped-out ones coming back, then waiting ones."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._preempt_for_waiting(out)
            self.running.sort(key=self._rank)
        preempted = out.num_preempted
        budget = self._schedule_running(out, budget)
        # No admissions in a step that ran out of blocks: they would be undone next step.
        if out.num_preempted == preempted:
            seats = self._free_seats()
            budget, seats = self._swap_in(out, budget, seats)
            self._admit_waiting(out, budget, seats)
        self._describe(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences, in rank order; the lowest-ranked make room when blocks run out. Returns the
        budget left."""
        seqs, b = out.seqs, out.batch
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.reached_length_limit:
                i += 1  # its last token is still being sampled and ends it (see LLMEngine.advance)
                continue
            left = seq.num_uncomputed_tokens
            n = min(left, budget)
            while (copies := self.bm.allocate(seq, n)) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; self.running shrank
            b.block_copies += copies
            seqs.append(seq)
            b.num_tokens.append(n)
            b.num_samples.append(seq.num_samples if n == left else 0)
            budget -= n
            i += 1
        return budget

    def _swap_in(self, out: SchedulerOutput, budget: int, seats: int) -> tuple[int, int]:
        """Swapped-out sequences come back before new ones. Returns the budget and seats left."""
        while (seq := self.swap.first()) is not None and budget > 0 and seats >= seq.num_samples:
            n = min(seq.num_uncomputed_tokens, budget)
            copies = self.swap.swap_in(seq, n)
            if copies is None:
                break
            out.batch.swap_in += copies
            out.batch.block_copies += self.bm.allocate(seq, n)
            self._admit(seq, n, out)
            seats -= seq.num_samples
            budget -= n
        return budget, seats

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int) -> None:
        """Waiting sequences, new or preempted, with whatever the prefix cache already holds (a request that
        has not forked yet takes the seats of all its n samples)."""
        while budget > 0 and not self.swap.queue and (seq := self.waiting.first()) is not None:
            if seats < seq.num_samples or not self._acquire_lora(seq):
                break
            # A prompt's logprobs come from computing it: one that asks for them reads nothing from the cache.
            cached = [] if seq.request.needs_prompt_logprobs else self.bm.find_cached(seq)
            n = min(seq.num_uncomputed_tokens - len(cached) * self.bm.block_size, budget)
            copies = self.bm.allocate(seq, n, cached)
            if copies is None:
                self._release_lora(seq)
                break
            if seq.request.metrics.first_scheduled_time is None:
                self.bm.count_query(seq.num_prompt_tokens)
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.pop()
            self._count_waiting_lora(seq, -1)
            out.batch.block_copies += copies
            self._admit(seq, n, out)
            seats -= seq.num_samples
            budget -= n

    def _admit(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.seqs.append(seq)
        out.batch.num_tokens.append(n)
        out.batch.num_samples.append(seq.num_samples if n == seq.num_uncomputed_tokens else 0)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.num_preempted += 1
        copies = self.swap.swap_out(seq)
        if copies is not None:
            out.batch.swap_out += copies
        else:
            self.bm.free_seq(seq)
            self._release_lora(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.push(seq, preempted=True)
            self._count_waiting_lora(seq, 1)

    def _acquire_lora(self, seq: Sequence) -> bool:
        """Give a sequence about to be admitted its adapter's slot; False when no slot is free for it."""
        lora = seq.request.lora_request
        if lora is None or seq.lora_slot >= 0:
            return True
        slot = self.loras.acquire(lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.loras.release(seq.lora_slot)
            seq.lora_slot = -1

    def _count_waiting_lora(self, seq: Sequence, change: int) -> None:
        if self.loras is not None and seq.request.lora_request is not None:
            self.loras.count_waiting(seq.request.lora_request, change)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority policy: a waiting request ranked above a running one takes its place when the batch
        is full (seats or blocks)."""
        while (best := self.waiting.first()) is not None and self.running:
            worst = max(self.running, key=self._rank)
            if self._rank(best) >= self._rank(worst):
                return
            seats = self._free_seats()
            need = self.bm.blocks_needed(min(best.num_uncomputed_tokens, self.config.max_num_batched_tokens))
            if seats >= best.num_samples and need <= self.bm.num_free_blocks:
                return
            self._preempt(worst, out)

    def _describe(self, out: SchedulerOutput) -> None:
        """The rest of the runner's plain view of the step, read off the scheduled sequences."""
        seqs, b = out.seqs, out.batch
        b.seq_ids = [s.seq_id for s in seqs]
        b.num_computed = [s.num_computed_tokens for s in seqs]
        b.token_ids = [s.token_ids for s in seqs]
        b.block_tables = [s.block_table for s in seqs]
        b.sampling = [s.sampling for s in seqs]
        b.prompt_logprobs = [
            i for i, s in enumerate(seqs) if s.request.prompt_logprobs is not None and s.request.needs_prompt_logprobs
        ]
        if self.loras is not None and seqs:  # (an empty step is not run: its loads wait for the next)
            b.lora_slots = [s.lora_slot for s in seqs]
            b.lora_loads = self.loras.take_loads()

    # -- after the step is launched ----------------------------------------------------------------------

    def commit(self, out: SchedulerOutput) -> None:
        """The step is launched: its tokens' K/V count as cached (the full blocks are named for the prefix
        cache), and each sequence that draws has one more token, on the device until it is read back."""
        for seq, n, draws in zip(out.seqs, out.batch.num_tokens, out.batch.num_samples):
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq, before)
            if draws:
                seq.add_pending()
