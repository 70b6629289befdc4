"""Which captured CUDA graph runs a step: decode batches by sequence count, small steps by the smallest token
bucket whose sequence cap holds them, steps of many sequences by the mixed graphs' token bucket and query
tiles, anything larger eagerly."""

from __future__ import annotations

from heron.executor.graph_keys import MIXED_TOKENS, GraphKeys, is_decode


def test_default_limits():
    keys = GraphKeys.plan(max_num_seqs=256, max_num_batched_tokens=8192, prefill=True)
    assert keys.decode_sizes == [1, 2, 4, *range(8, 257, 8)]
    assert keys.prefill == [(16, 8, 16), (32, 8, 32), (64, 8, 64), (128, 8, 128), (256, 8, 256), (512, 8, 512)]
    assert keys.mixed == sorted({(t, min(t - 1, 256), q) for t in MIXED_TOKENS for q in (64, t)})
    every = keys.all()
    assert every == sorted(every, reverse=True) and every[0] == (2048, 256, 2048) and every[-1] == (1, 1, 1)
    assert len(every) == len(set(every)) == len(keys.decode_sizes) + len(keys.prefill) + len(keys.mixed)
    assert not any(is_decode(k) for k in keys.prefill + keys.mixed)


def test_decode_steps_take_the_next_decode_size():
    keys = GraphKeys.plan(256, 8192, prefill=True)
    assert keys.for_step(1, 1, decode=True, max_query_len=1) == (1, 1, 1)
    assert keys.for_step(3, 3, decode=True, max_query_len=1) == (4, 4, 1)
    assert keys.for_step(8, 8, decode=True, max_query_len=1) == (8, 8, 1)
    assert keys.for_step(9, 9, decode=True, max_query_len=1) == (16, 16, 1)
    assert keys.for_step(256, 256, decode=True, max_query_len=1) == (256, 256, 1)


def test_small_steps_take_the_smallest_bucket_that_holds_them():
    keys = GraphKeys.plan(256, 8192, prefill=True)
    assert keys.for_step(2, 1, decode=False, max_query_len=2) == (16, 8, 16)
    assert keys.for_step(16, 1, decode=False, max_query_len=16) == (16, 8, 16)  # exactly at a bucket
    assert keys.for_step(17, 1, decode=False, max_query_len=17) == (32, 8, 32)
    assert keys.for_step(128, 1, decode=False, max_query_len=128) == (128, 8, 128)
    # a few sequences keep to the small graphs even where a mixed one has fewer tokens
    assert keys.for_step(300, 3, decode=False, max_query_len=290) == (512, 8, 512)
    assert keys.for_step(512, 8, decode=False, max_query_len=500) == (512, 8, 512)


def test_many_sequences_take_a_mixed_graph():
    """The steady state of many short requests: a full batch of decode rows beside a few new prompts."""
    keys = GraphKeys.plan(256, 8192, prefill=True)
    assert keys.for_step(40, 9, decode=False, max_query_len=32) == (64, 63, 64)
    assert keys.for_step(300, 256, decode=False, max_query_len=40) == (320, 256, 64)
    assert keys.for_step(500, 256, decode=False, max_query_len=40) == (512, 256, 64)
    assert keys.for_step(500, 256, decode=False, max_query_len=65) == (512, 256, 512)  # a longer chunk
    assert keys.for_step(513, 250, decode=False, max_query_len=64) == (640, 256, 64)
    assert keys.for_step(2048, 200, decode=False, max_query_len=1800) == (2048, 256, 2048)
    assert keys.for_step(2049, 1, decode=False, max_query_len=2049) is None  # over the largest bucket: eager


def test_mixed_graphs_span_no_more_slots_than_their_tokens_allow():
    """At 1,024 seats a mixed step of a few hundred tokens pads to a graph of a few hundred sequence slots (the
    attention grids have a row of programs per slot), and a full batch beside new prompts to all 1,024."""
    keys = GraphKeys.plan(1024, 8192, prefill=True)
    assert keys.for_step(300, 250, decode=False, max_query_len=40) == (320, 319, 64)
    assert keys.for_step(1100, 1024, decode=False, max_query_len=40) == (1280, 1024, 64)
    assert keys.for_step(1024, 1000, decode=False, max_query_len=25) == (1024, 1023, 64)
    assert keys.for_step(1025, 1024, decode=False, max_query_len=2) == (1280, 1024, 64)
    assert all(seqs <= min(tokens - 1, 1024) for tokens, seqs, _ in keys.mixed)


def test_small_max_num_batched_tokens_is_the_last_bucket():
    keys = GraphKeys.plan(256, 100, prefill=True)
    assert keys.prefill == [(16, 8, 16), (32, 8, 32), (64, 8, 64), (100, 8, 100)]
    assert keys.mixed == [(64, 63, 64), (100, 99, 64), (100, 99, 100)]
    assert keys.for_step(65, 2, decode=False, max_query_len=60) == (100, 8, 100)
    assert keys.for_step(100, 2, decode=False, max_query_len=99) == (100, 8, 100)
    assert keys.for_step(40, 9, decode=False, max_query_len=32) == (64, 63, 64)
    assert keys.for_step(101, 9, decode=False, max_query_len=32) is None  # over the step cap: eager
    assert GraphKeys.plan(256, 600, prefill=True).prefill[-1] == (512, 8, 512)
    assert GraphKeys.plan(256, 600, prefill=True).mixed[-1] == (600, 256, 600)
    assert GraphKeys.plan(256, 512, prefill=True).prefill[-1] == (512, 8, 512)


def test_tiny_limits_keep_prefill_keys_apart_from_decode_ones():
    """A step that is not a decode has a chunk of two tokens or more, so at most T - 1 sequences."""
    keys = GraphKeys.plan(max_num_seqs=8, max_num_batched_tokens=8, prefill=True)
    assert keys.decode_sizes == [1, 2, 4, 8] and keys.prefill == [(8, 7, 8)] and keys.mixed == []
    assert keys.for_step(8, 7, decode=False, max_query_len=2) == (8, 7, 8)
    assert keys.for_step(8, 8, decode=True, max_query_len=1) == (8, 8, 1)
    assert GraphKeys.plan(8, 1, prefill=True).prefill == []  # no step of two tokens fits
    # decode steps have at most max_num_batched_tokens sequences: no graph beyond that
    assert GraphKeys.plan(256, 20, prefill=False).decode_sizes == [1, 2, 4, 8, 16, 20]


def test_few_sequences_cap_the_prefill_graphs():
    keys = GraphKeys.plan(max_num_seqs=3, max_num_batched_tokens=2048, prefill=True)
    assert keys.decode_sizes == [1, 2, 3] and keys.mixed == []
    assert all(seqs == 3 for _, seqs, _ in keys.prefill)
    assert keys.for_step(20, 3, decode=False, max_query_len=18) == (32, 3, 32)
    assert keys.for_step(3, 3, decode=True, max_query_len=1) == (3, 3, 1)


def test_backends_without_prefill_graphs_and_no_graphs():
    keys = GraphKeys.plan(16, 8192, prefill=False)
    assert keys.prefill == keys.mixed == [] and keys.for_step(20, 1, decode=False, max_query_len=20) is None
    assert keys.for_step(5, 5, decode=True, max_query_len=1) == (8, 8, 1)
    none = GraphKeys([], [])  # before capture, on the CPU, or with enforce_eager
    assert none.for_step(1, 1, decode=True, max_query_len=1) is None
    assert none.for_step(20, 1, decode=False, max_query_len=20) is None
    assert none.all() == []
