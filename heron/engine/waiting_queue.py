"""The scheduler's waiting queue: sequences not admitted yet (new, or preempted and to be recomputed), in the
order they are admitted. Every operation costs O(log n) at most, so that a batch job of a million requests
queued at once costs the same per request as a few.

Order: by rank, (arrival time) under fcfs or (priority, arrival time) under the priority policy, ties in the
order added. Under fcfs a preempted sequence goes before every other, the last one preempted first (the
scheduler preempts the lowest-ranked first, so the front keeps their rank order); under the priority policy
it goes back by its rank. A heap holds the ranked sequences and a deque the preempted ones; a sequence
removed from the middle (aborted) is only marked, and skipped when it reaches the front.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from heron.engine.request import Sequence


def rank(seq: Sequence, policy: str) -> tuple:
    """The scheduling rank of a sequence: lower runs first."""
    r = seq.request
    return (r.priority, r.arrival_time) if policy == "priority" else (r.arrival_time,)


class WaitingQueue:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._front: deque[Sequence] = deque()  # fcfs: preempted sequences, ahead of the heap
        self._heap: list[tuple] = []  # (*rank, order added, sequence)
        self._order = itertools.count()
        self._removed: set[Sequence] = set()  # still in _front or _heap, to be skipped
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, seq: Sequence, preempted: bool = False) -> None:
        if preempted and self.policy == "fcfs":
            self._front.appendleft(seq)
        else:
            heapq.heappush(self._heap, (*rank(seq, self.policy), next(self._order), seq))
        self._len += 1

    def first(self) -> Sequence | None:
        """The sequence to admit next, or None."""
        front, heap, removed = self._front, self._heap, self._removed
        while front and front[0] in removed:
            removed.discard(front.popleft())
        if front:
            return front[0]
        while heap and heap[0][-1] in removed:
            removed.discard(heapq.heappop(heap)[-1])
        return heap[0][-1] if heap else None

    def pop(self) -> Sequence:
        """Take the `first` sequence out."""
        seq = self.first()
        if seq is None:
            raise IndexError("pop from an empty WaitingQueue")
        if self._front:
            self._front.popleft()
        else:
            heapq.heappop(self._heap)
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take out a sequence that is in the queue, wherever it is (it has finished: it never comes back)."""
        self._removed.add(seq)
        self._len -= 1
