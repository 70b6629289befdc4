"""Parallel sampling: an n > 1 request runs as one sequence that holds all n seats until its first draw, then
forks into n sequences sharing its blocks; a shared, partly filled block is copied on the first write to it
(copy-on-write), the full ones stay shared."""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams
from heron.engine.block_manager import BlockManager
from heron.engine.parallel_sampling import ParallelSampling
from heron.engine.request import Request, SequenceStatus
from tests.engine.test_block_manager import compute, no_leaks
from tests.engine.test_scheduler import make_scheduler


def test_fork_shares_the_prompt_blocks_and_copies_the_partial_one_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    forks = ParallelSampling(bm)
    req = Request("r", None, list(range(6)), SamplingParams(n=3), seed=11)
    seq = req.seqs[0]
    forks.add(seq)
    assert seq.num_samples == 3  # its first draw yields all three first tokens
    compute(bm, seq, 6)
    seq.add_pending()  # that draw is launched
    children = forks.fork(seq)
    assert req.seqs == [seq, *children] and [c.index for c in children] == [1, 2]
    assert [s.sampling.index for s in req.seqs] == [0, 1, 2] and {s.sampling.ints[1] for s in req.seqs} == {11}
    for c in children:
        assert c.token_ids == seq.token_ids and c.token_ids is not seq.token_ids
        assert (c.num_computed_tokens, c.num_pending, c.num_samples) == (6, 1, 1)
        assert c.block_table == seq.block_table
    full, partial = seq.block_table
    assert bm.ref_count[full] == bm.ref_count[partial] == 3
    for s, token in zip(req.seqs, (7, 8, 9)):
        s.append_token(token)
    copies = [bm.allocate(s, 1) for s in req.seqs]  # each writes its token at position 6, in the partial block
    assert copies == [[(partial, req.seqs[0].block_table[1])], [(partial, req.seqs[1].block_table[1])], []]
    assert len({s.block_table[1] for s in req.seqs}) == 3  # the last holder writes in place
    assert all(s.block_table[0] == full for s in req.seqs) and bm.ref_count[full] == 3
    for s in req.seqs:
        bm.free_seq(s)
    assert no_leaks(bm)


def _request(sched, rid: str, n: int = 1, prompt_len: int = 6) -> Request:
    req = Request(rid, None, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=4), arrival_time=len(rid))
    sched.add(req.seqs[0])
    return req


def test_an_unforked_request_holds_all_its_seats_until_it_forks():
    sched = make_scheduler(max_num_seqs=3)
    big, small = _request(sched, "big", n=3), _request(sched, "small!")
    out = sched.schedule()
    assert out.seqs == big.seqs and out.batch.num_samples == [3]  # one sequence, three seats: small waits
    sched.commit(out)
    children = sched.fork(big.seqs[0])
    assert sched.running == big.seqs == [big.seqs[0], *children]
    for s in big.seqs:
        s.append_token(7)
    out = sched.schedule()
    assert out.seqs == big.seqs and out.batch.num_samples == [1, 1, 1]
    for s in big.seqs:
        sched.finish(s)
    assert sched.schedule().seqs == small.seqs


def test_a_request_finished_before_forking_gives_its_seats_back():
    sched = make_scheduler(max_num_seqs=3)
    big, small = _request(sched, "big", n=3, prompt_len=40), _request(sched, "small!")
    out = sched.schedule()  # a 32-token chunk of big's prompt: no draw yet, and three seats held
    assert out.seqs == big.seqs and out.batch.num_samples == [0]
    sched.commit(out)
    sched.finish(big.seqs[0])  # aborted mid-prompt
    assert big.seqs[0].status is SequenceStatus.FINISHED
    assert sched.schedule().seqs == small.seqs


@pytest.mark.slow
def test_a_forking_draw_beside_a_mid_prompt_chunk_samples_its_own_logits(tiny_model_dir):
    """A step of one-token chunks where one sequence forks (two sampling rows) and another is mid-prompt (none):
    both samples come from the forking sequence's logits, so greedy ones equal each other and n = 1's."""
    llm = LLM(tiny_model_dir("qwen3"), device="cpu", max_num_seqs=3, max_num_batched_tokens=2, kv_cache_memory=64 << 20)
    greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
    alone = llm.generate([[5]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("fork", [5], SamplingParams(n=2, **greedy))
    engine.add_request("chunked", [7, 8, 9, 10, 11], SamplingParams(**greedy))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [c.token_ids for c in outs["fork"].outputs] == [alone, alone]
