"""The replica router's policies: prefix affinity, the overload fallback, sticky sessions, forgetting what a
replica's cache would have evicted, and a cost per request that does not grow with the requests routed."""

from __future__ import annotations

import time

import pytest

from heron.engine.router import CacheAware, LeastLoaded, RoundRobin, block_hashes


def test_block_hashes_agree_exactly_as_far_as_prompts_do():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    c = block_hashes([7] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert c[0] != a[0] and c[1] != a[1]  # chained: a different first block changes every later hash


def test_round_robin_and_least_loaded():
    rr = RoundRobin(3)
    assert [rr.choose([]) for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    ll = LeastLoaded(3)
    first = [ll.choose([]) for _ in range(3)]
    assert sorted(first) == [0, 1, 2]
    ll.finished(2)
    assert ll.choose([]) == 2


def test_cache_aware_sends_a_shared_prefix_where_its_blocks_are():
    router = CacheAware(4, cache_blocks=100)
    system = list(range(64))
    homes = {}
    for i in range(4):
        prompt = system + [1000 + i] * 16
        r = router.choose(block_hashes(prompt, 16))
        homes.setdefault(r, 0)
        homes[r] += 1
    assert list(homes.values()) == [4]  # all four on the replica that has the system prompt (within the slack)
    other = router.choose(block_hashes([5000] * 80, 16))
    assert other != next(iter(homes))  # an unrelated prompt goes to the least loaded, not the busy cached one


def test_overloaded_home_gives_way_to_the_least_loaded():
    router = CacheAware(2, cache_blocks=100, slack=2)
    hashes = block_hashes(list(range(64)), 16)
    picks = [router.choose(hashes) for _ in range(6)]  # none finish: the home's queue grows
    home = picks[0]
    assert picks[:3] == [home] * 3  # within the slack the cache wins
    assert (1 - home) in picks[3:]  # past it the other replica takes some


def test_sticky_sessions_and_forgetting_evicted_blocks():
    router = CacheAware(2, cache_blocks=4)
    first = router.choose(block_hashes(list(range(64)), 16), user="alice")
    router.finished(first)
    router.choose([], user="bob")  # least loaded; then alice comes back with an unrelated prompt
    assert router.choose(block_hashes([9] * 64, 16), user="alice") == first
    # 4 blocks of capacity: a new 4-block prompt on the same replica evicts the first prompt's blocks
    router = CacheAware(2, cache_blocks=4)
    a = router.choose(block_hashes(list(range(64)), 16))
    router.finished(a)
    b = router.choose(block_hashes(list(range(100, 164)), 16))  # no match, all idle: the least loaded, `a` again
    assert a == b
    assert router._holders.keys() == set(block_hashes(list(range(100, 164)), 16))


@pytest.mark.parametrize("replicas", [256])
def test_cost_per_request_does_not_grow_with_requests(replicas):
    router = CacheAware(replicas, cache_blocks=1000)
    prompts = [block_hashes([i % 64] * 512 + [i] * 64, 16) for i in range(4000)]

    def run(batch):
        start = time.perf_counter()
        for p in batch:
            router.finished(router.choose(p))
        return time.perf_counter() - start

    early, late = run(prompts[:2000]), run(prompts[2000:])
    assert late < 3 * early  # the same work costs the same later, whatever was routed before


def test_removed_replicas_are_never_picked():
    prompt = block_hashes(list(range(64)), 16)
    for router in (RoundRobin(3), LeastLoaded(3), CacheAware(3, cache_blocks=100)):
        home = router.choose(prompt, user="u")
        router.remove(home)
        picks = {router.choose(prompt, user="u") for _ in range(6)}  # its blocks, its session: elsewhere now
        assert home not in picks and len(picks) >= 1
    router = CacheAware(2, cache_blocks=100)
    router.remove(0)
    router.remove(1)
    with pytest.raises(RuntimeError, match="no replica"):
        router.choose(prompt)


def test_a_full_kv_cache_gives_way():
    router = CacheAware(2, cache_blocks=100)
    prompt = block_hashes(list(range(64)), 16)
    home = router.choose(prompt)
    router.finished(home)
    router.kv_usage[home] = 0.99  # the home's cache is full, the other's is not: a hit is not worth the wait
    assert router.choose(prompt) == 1 - home
