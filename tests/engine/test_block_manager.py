import hashlib

import numpy as np

from heron.engine import block_manager
from heron.engine.block_manager import BlockManager
from heron.engine.request import Request
from heron.sampling_params import SamplingParams


def make_seq(tokens: list[int], rid: str = "r"):
    return Request(rid, None, tokens, SamplingParams()).seqs[0]


def no_leaks(bm: BlockManager) -> bool:
    """Every block is free (cached or not) and unreferenced."""
    return bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_count)


def compute(bm: BlockManager, seq, n: int) -> None:
    """What the scheduler does around a model step: allocate, then mark computed and cache full blocks."""
    assert bm.allocate(seq, n) is not None
    before = seq.num_computed_tokens
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq, before)


def test_allocate_counts_blocks_and_refuses_when_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(10)))
    assert bm.allocate(a, 10) == []
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    b = make_seq(list(range(100, 108)), "b")
    assert bm.allocate(b, 8) is None  # needs 2, 1 free: nothing changes
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free_seq(a)
    assert no_leaks(bm)


def test_prefix_reuse_and_hit_counting():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(11))  # two full blocks and a partial one
    a = make_seq(prompt)
    compute(bm, a, 11)
    b = make_seq(prompt + [99], "b")
    hits = bm.find_cached(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 12 - 8, hits) == []
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert all(bm.ref_count[x] == 2 for x in a.block_table[:2])
    assert bm.prefix_hits == 8
    bm.free_seq(a)
    bm.free_seq(b)
    assert no_leaks(bm)


def test_fully_cached_prompt_leaves_last_block_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free_seq(a)
    b = make_seq(list(range(8)), "b")
    hits = bm.find_cached(b)
    assert len(hits) == 1  # the last token must run through the model, in a block of its own
    assert bm.allocate(b, 4, hits) == []
    assert b.num_computed_tokens == 4 and b.block_table[0] == hits[0]


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 3, 4], "a"), make_seq([5, 6, 7, 8], "b")
    compute(bm, a, 4)
    compute(bm, b, 4)
    a_blocks = list(a.block_table)
    bm.free_seq(a)  # a's blocks become the least recently used
    bm.free_seq(b)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 4
    c = make_seq([9, 10, 11], "c")
    compute(bm, c, 3)  # two blocks: a's, evicted tail first
    assert set(c.block_table) == set(a_blocks)
    assert bm.find_cached(make_seq([1, 2, 3, 4, 0], "a2")) == []
    assert len(bm.find_cached(make_seq([5, 6, 7, 8, 0], "b2"))) == 2


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(9)))
    compute(bm, a, 9)
    held = make_seq(list(range(50, 54)), "held")
    compute(bm, held, 4)
    bm.free_seq(a)
    assert len(bm.find_cached(make_seq(list(range(9)), "a2"))) == 2
    assert not bm.reset_prefix_cache()  # `held` still holds a block: nothing changes
    assert len(bm.find_cached(make_seq(list(range(9)), "a3"))) == 2
    bm.free_seq(held)
    assert bm.reset_prefix_cache()
    assert bm.find_cached(make_seq(list(range(9)), "a4")) == [] and not bm.hash_to_block
    assert no_leaks(bm)
    b = make_seq(list(range(9)), "b")
    compute(bm, b, 9)  # the blocks are found again once recomputed
    assert len(bm.find_cached(make_seq(list(range(9)), "b2"))) == 2


def test_block_hashes_are_the_sha256_chain_and_a_shared_prefix_is_hashed_once(monkeypatch):
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    a, b = make_seq(prefix + [1, 2, 3, 4, 5], "a"), make_seq(prefix + [9, 9], "b")
    want, h = [], b""
    for i in range(0, 16, 4):
        h = hashlib.sha256(h + np.asarray(a.token_ids[i : i + 4], dtype=np.int64).tobytes()).digest()
        want.append(h)
    bm.find_cached(a)
    assert a.block_hashes == want and len(bm.hash_memo) == 4
    bm.find_cached(b)
    assert all(x is y for x, y in zip(b.block_hashes, a.block_hashes[:3]))  # the memo's own objects
    assert len(bm.hash_memo) == 4  # nothing new: b's three full blocks are a's
    monkeypatch.setattr(block_manager, "HASH_MEMO_ENTRIES", 3)
    c = make_seq([7] * 8, "c")
    bm.find_cached(c)  # past the bound: cleared first, then c's two blocks
    sevens = np.asarray([7] * 4, dtype=np.int64).tobytes()
    assert len(bm.hash_memo) == 2 and c.block_hashes[1] == hashlib.sha256(c.block_hashes[0] + sevens).digest()
    assert bm.reset_prefix_cache() and not bm.hash_memo


def test_uncached_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4])
    compute(bm, a, 4)
    a_blocks = list(a.block_table)
    bm.free_seq(a)
    c = make_seq([7, 8, 9], "c")
    compute(bm, c, 3)
    assert not set(c.block_table) & set(a_blocks)
    assert len(bm.find_cached(make_seq([1, 2, 3, 4, 5], "a2"))) == 2


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(list(range(6)))
    compute(bm, parent, 6)
    child = make_seq(list(range(6)), "child")
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.ref_count[b] == 2 for b in parent.block_table)
    free_before = bm.num_free_blocks
    for s in (parent, child):
        s.token_ids.append(42)
    copies = bm.allocate(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.allocate(parent, 1) == []  # now the only holder of its partial block: writes in place
    assert bm.num_free_blocks == free_before - 1
    bm.free_seq(parent)
    bm.free_seq(child)
    assert no_leaks(bm)


def test_release_keeps_the_computed_count_and_assign_gives_fresh_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(7)))
    compute(bm, a, 7)
    bm.release_blocks(a)
    assert a.block_table == [] and a.num_computed_tokens == 7 and bm.num_free_blocks == 4
    assert bm.assign_blocks(a, 2) == a.block_table and len(set(a.block_table)) == 2
    assert all(bm.ref_count[b] == 1 for b in a.block_table) and bm.num_free_blocks == 2
    bm.free_seq(a)
    assert no_leaks(bm) and a.num_computed_tokens == 0


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4])
    compute(bm, a, 4)
    assert bm.hash_to_block == {} and bm.find_cached(make_seq([1, 2, 3, 4, 5], "b")) == []


def test_blocks_out_of_every_layers_window_are_released():
    """All-sliding (Mistral): a long generation holds about window / block_size + 2 blocks, the table keeps
    indexing positions, and everything comes back at the end; forks and swaps keep the count right."""
    from heron.engine.swap_space import SwapSpace

    window, bs = 8, 4
    bm = BlockManager(num_blocks=16, block_size=bs, sliding_window=window)
    seq = make_seq(list(range(10)))
    compute(bm, seq, 10)  # the prompt
    held = []
    for _ in range(200):  # decode: one token per step
        seq.token_ids.append(0)
        compute(bm, seq, 1)
        held.append(bm.blocks_held(seq))
        assert bm.num_blocks - bm.num_free_blocks == held[-1]
    assert max(held) <= window // bs + 2 and len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    child = make_seq(list(seq.token_ids), "child")
    bm.fork(seq, child)
    assert bm.blocks_held(child) == bm.blocks_held(seq) and bm.num_blocks - bm.num_free_blocks == held[-1]
    bm.free_seq(child)
    swap = SwapSpace(bm, num_cpu_blocks=8)
    out = swap.swap_out(seq)
    assert len(out) == held[-1] and no_leaks(bm)
    back = swap.swap_in(seq, 1)
    assert [d for _, d in back] == seq.block_table[seq.num_dropped_blocks :] and len(back) == held[-1]
    assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    bm.free_seq(seq)
    assert no_leaks(bm) and seq.block_table == [] and seq.num_dropped_blocks == 0


def test_a_layer_that_sees_everything_keeps_every_block():
    bm = BlockManager(num_blocks=64, block_size=4)  # no window: Llama, or Gemma's global layers
    seq = make_seq(list(range(10)))
    compute(bm, seq, 10)
    for _ in range(100):
        seq.token_ids.append(0)
        compute(bm, seq, 1)
    assert bm.blocks_held(seq) == len(seq.block_table) == bm.blocks_needed(110)
