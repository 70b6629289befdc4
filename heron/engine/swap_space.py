"""Preemption by swapping (`swap_space` GiB of host memory, as in vLLM).

A preempted sequence's KV blocks are copied to host blocks and its device blocks freed; it keeps its
computed tokens and comes back, before any waiting request, into fresh device blocks. Without room on the
host it is recomputed instead (the scheduler frees its blocks and queues it again). This module only
decides which blocks go where: the copies are the model runner's (ScheduledBatch.swap_out / swap_in).

The scheduler's side: `swap_out` a victim (None: no room), `first` and `swap_in` to bring sequences
back in order, `discard` one that finishes while out.
"""

from __future__ import annotations

from heron.engine.block_manager import BlockManager
from heron.engine.request import Sequence, SequenceStatus


class SwapSpace:
    def __init__(self, block_manager: BlockManager, num_cpu_blocks: int) -> None:
        self.bm = block_manager
        self.free: list[int] = list(range(num_cpu_blocks))  # free host blocks
        self.queue: list[Sequence] = []  # swapped out, in the order they left
        self._host_blocks: dict[Sequence, list[int]] = {}  # a swapped-out sequence's blocks, in order

    def __len__(self) -> int:
        return len(self.queue)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s blocks to host blocks and queue it; returns the (device, host) copies to make, or
        None (nothing changed) when the host has no room for them."""
        if not self.free or self.bm.blocks_held(seq) > len(self.free):
            return None
        copies = [(b, self.free.pop()) for b in seq.block_table[seq.num_dropped_blocks :]]
        self._host_blocks[seq] = [c for _, c in copies]
        self.bm.release_blocks(seq)
        seq.status = SequenceStatus.SWAPPED
        self.queue.append(seq)
        return copies

    def first(self) -> Sequence | None:
        """The sequence to bring back next."""
        return self.queue[0] if self.queue else None

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring back the `first` sequence into fresh device blocks, if there is room for them and for the
        `num_new_tokens` it computes next; returns the (host, device) copies to make, or None (nothing
        changed)."""
        needed = self.bm.blocks_needed(seq.num_computed_tokens + num_new_tokens) - seq.num_dropped_blocks
        if needed > self.bm.num_free_blocks:
            return None
        self.queue.pop(0)
        host = self._host_blocks.pop(seq)
        device = self.bm.assign_blocks(seq, len(host))
        self.free += host
        return list(zip(host, device))

    def discard(self, seq: Sequence) -> None:
        """`seq` finished (or was aborted): if it is out, its host blocks are free again."""
        host = self._host_blocks.pop(seq, None)
        if host is not None:
            self.queue.remove(seq)
            self.free += host
