"""Swap preemption: a victim's blocks go to host blocks and come back into fresh device blocks with its computed
tokens; without room (on the host to leave, on the device to come back) nothing moves."""

from __future__ import annotations

from heron.engine.block_manager import BlockManager
from heron.engine.request import SequenceStatus
from heron.engine.swap_space import SwapSpace
from tests.engine.test_block_manager import compute, make_seq, no_leaks
from tests.engine.test_scheduler import add, make_scheduler, step


def test_swap_out_and_in_round_trip():
    bm = BlockManager(num_blocks=4, block_size=4)
    swap = SwapSpace(bm, num_cpu_blocks=4)
    a = make_seq(list(range(7)))
    compute(bm, a, 7)
    table = list(a.block_table)
    out = swap.swap_out(a)
    assert [d for d, _ in out] == table and len({h for _, h in out}) == 2
    assert a.block_table == [] and a.num_computed_tokens == 7 and a.status is SequenceStatus.SWAPPED
    assert bm.num_free_blocks == 4 and swap.first() is a and len(swap) == 1 and len(swap.free) == 2
    a.token_ids.append(1)
    back = swap.swap_in(a, 1)
    assert [h for h, _ in back] == [h for _, h in out] and a.block_table == [d for _, d in back]
    assert swap.first() is None and len(swap.free) == 4
    assert bm.allocate(a, 1) == []  # the next token fits the last block brought back
    bm.free_seq(a)
    assert no_leaks(bm)


def test_without_host_room_nothing_moves():
    for host_blocks in (0, 1):
        bm = BlockManager(num_blocks=4, block_size=4)
        swap = SwapSpace(bm, num_cpu_blocks=host_blocks)
        a = make_seq(list(range(7)))
        compute(bm, a, 7)
        table = list(a.block_table)
        assert swap.swap_out(a) is None
        assert a.block_table == table and a.status is SequenceStatus.WAITING and len(swap) == 0
        assert len(swap.free) == host_blocks and bm.num_free_blocks == 2


def test_swap_in_waits_for_device_room():
    bm = BlockManager(num_blocks=4, block_size=4)
    swap = SwapSpace(bm, num_cpu_blocks=4)
    a, b = make_seq(list(range(7))), make_seq(list(range(100, 108)), "b")
    compute(bm, a, 7)
    swap.swap_out(a)
    compute(bm, b, 8)
    compute(bm, b, 4)  # b holds 3 of the 4 blocks; a needs 2
    assert swap.swap_in(a, 1) is None
    assert swap.first() is a and a.block_table == [] and len(swap.free) == 2
    bm.free_seq(b)
    assert swap.swap_in(a, 1) is not None and len(a.block_table) == 2


def test_discard_gives_the_host_blocks_back():
    bm = BlockManager(num_blocks=4, block_size=4)
    swap = SwapSpace(bm, num_cpu_blocks=4)
    a, b = make_seq(list(range(7))), make_seq(list(range(5)), "b")
    compute(bm, a, 7)
    compute(bm, b, 5)
    swap.swap_out(a)
    swap.discard(b)  # not out: nothing to give back
    assert len(swap.free) == 2 and swap.first() is a
    swap.discard(a)
    assert len(swap.free) == 4 and swap.first() is None


def test_a_swapped_out_sequence_resumes_where_it_stopped():
    # 6 blocks of 4 tokens; two requests that grow to 5 blocks each cannot both stay
    sched = make_scheduler(num_blocks=6, max_num_seqs=2, max_tokens=64, swap_blocks=8)
    for rid in "ab":
        add(sched, rid, prompt_len=10, max_tokens=10)
    while not sched.swap.queue:
        out = step(sched)
    victim = sched.swap.first()
    computed, host = victim.num_computed_tokens, [h for d, h in out.batch.swap_out]
    assert computed >= 10 and victim.block_table == [] and len(host) == -(-computed // 4)
    while victim.status is not SequenceStatus.RUNNING:
        out = step(sched)
    i = out.seqs.index(victim)
    # its K/V came back: only its last token is computed, not the whole sequence again
    assert [h for h, _ in out.batch.swap_in] == host
    assert (out.batch.num_computed[i], out.batch.num_tokens[i]) == (computed, 1)
