"""--max-waiting-requests: one count for the whole server (every endpoint that starts engine requests),
checked and taken in one step on the event loop, with no await between, so that a burst of simultaneous
requests cannot all pass the check before any of them counts."""

from __future__ import annotations

RETRY_AFTER_S = 1  # a waiting request leaves the queue within a step or two of the engine: come back soon


class Overloaded(Exception):
    """More requests would wait than the server allows."""

    def __init__(self, waiting: int, limit: int) -> None:
        super().__init__(
            f"The server is overloaded: {waiting} requests are waiting for their first token "
            f"(--max-waiting-requests {limit}). Retry after {RETRY_AFTER_S} s."
        )


class Admission:
    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.waiting = 0  # engine requests accepted by the server that have no output yet

    def admit(self, count: int) -> list[Ticket]:
        """Take `count` places in the queue, or raise Overloaded; each ticket gives its place back once."""
        if self.limit is not None and self.waiting + count > self.limit:
            raise Overloaded(self.waiting, self.limit)
        self.waiting += count
        return [Ticket(self) for _ in range(count)]


class Ticket:
    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.waiting -= 1
            self._admission = None
