"""Which engine replica a request goes to, when several serve one model (data parallelism).

A router sees each request's prompt as the chained hashes of its full KV blocks (`block_hashes`) and an optional
`user` (a session key), and picks one of `num_replicas`. Three policies share that interface:

* `RoundRobin`: in turn, blind to prompts and load.
* `LeastLoaded`: the replica with the fewest requests outstanding (sent and not finished).
* `CacheAware`: the replica whose prefix cache holds the longest prefix of the prompt, as far as the router can
  tell without asking: it remembers the block hashes of the prompts it sent to each replica, in an LRU as large
  as a replica's cache (so a block is forgotten about when the replica would have evicted it), indexed as
  hash -> bitmask of replicas, so a lookup costs O(prompt blocks) whatever the number of replicas. Among the
  replicas with the longest match the least loaded wins; with no match, the user's last replica (sticky
  sessions), else the least loaded. A cache hit is not worth a queue: when the chosen replica has more than
  `slack` requests outstanding beyond the least loaded one, the least loaded takes the request instead.

Load is what the router knows at once: the requests it sent to a replica and that have not finished (waiting or
running there), ties broken by the replica's KV-cache usage as its last step reported it (`kv_usage`, kept by the
caller; a step old, so a burst is spread by the counts, not by it). A replica whose KV cache is full
(`KV_FULL`) counts as overloaded too. A replica that died is `remove`d: no policy picks it again.

Finding the least loaded replica is a scan over replicas (O(replicas), a few microseconds at 256), never
over requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence

KV_FULL = 0.95  # KV-cache usage from which a replica's cache hit no longer outweighs its queue


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of a prompt's full blocks: equal for two prompts exactly as far as they agree."""
    out, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out


class Router(ABC):
    """Picks a replica per request and counts what is outstanding on each."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}.")
        self.num_replicas = num_replicas
        self.outstanding = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.alive = [True] * num_replicas
        self._alive_mask = (1 << num_replicas) - 1

    def choose(self, hashes: Sequence[Hashable], user: str | None = None) -> int:
        if not self._alive_mask:
            raise RuntimeError("no replica is alive.")
        replica = self._pick(hashes, user)
        self.outstanding[replica] += 1
        return replica

    def finished(self, replica: int) -> None:
        self.outstanding[replica] -= 1

    def remove(self, replica: int) -> None:
        """Take a dead replica out of rotation, for good."""
        self.alive[replica] = False
        self._alive_mask &= ~(1 << replica)

    def least_loaded(self) -> int:
        return min(_bits(self._alive_mask), key=self._load)

    def _load(self, replica: int) -> tuple[int, float]:
        return self.outstanding[replica], self.kv_usage[replica]

    @abstractmethod
    def _pick(self, hashes: Sequence[Hashable], user: str | None) -> int: ...


class RoundRobin(Router):
    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _pick(self, hashes: Sequence[Hashable], user: str | None) -> int:
        self._next = (self._next + 1) % self.num_replicas
        while not self.alive[self._next]:
            self._next = (self._next + 1) % self.num_replicas
        return self._next


class LeastLoaded(Router):
    def _pick(self, hashes: Sequence[Hashable], user: str | None) -> int:
        return self.least_loaded()


class CacheAware(Router):
    def __init__(self, num_replicas: int, cache_blocks: int, slack: int = 8, max_sessions: int = 1 << 16) -> None:
        super().__init__(num_replicas)
        self.cache_blocks, self.slack, self.max_sessions = cache_blocks, slack, max_sessions
        self._holders: dict[Hashable, int] = {}  # block hash -> bitmask of the replicas believed to hold it
        self._lru: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def _pick(self, hashes: Sequence[Hashable], user: str | None) -> int:
        least = self.least_loaded()
        matched = 0
        alive = self._alive_mask
        for h in hashes:  # narrow the holders of the prompt's first k blocks, for k = 1, 2, ...
            narrowed = self._holders.get(h, 0) & (matched or alive)
            if not narrowed:
                break
            matched = narrowed
        if matched:
            replica = min(_bits(matched), key=self._load)
        elif user is not None and self.alive[self._sessions.get(user, least)]:
            replica = self._sessions.get(user, least)
        else:
            replica = least
        if self._overloaded(replica, least):
            replica = least
        self._remember(replica, hashes, user)
        return replica

    def _overloaded(self, replica: int, least: int) -> bool:
        """`replica` should give way to the least loaded one."""
        if self.outstanding[replica] > self.outstanding[least] + self.slack:
            return True
        return self.kv_usage[replica] >= KV_FULL > self.kv_usage[least]

    def _remember(self, replica: int, hashes: Sequence[Hashable], user: str | None) -> None:
        lru, bit = self._lru[replica], 1 << replica
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders[h] = self._holders.get(h, 0) | bit
        while len(lru) > self.cache_blocks:
            old, _ = lru.popitem(last=False)
            if rest := self._holders[old] & ~bit:
                self._holders[old] = rest
            else:
                del self._holders[old]
        if user is not None:
            self._sessions[user] = replica
            self._sessions.move_to_end(user)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}
