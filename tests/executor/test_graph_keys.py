"""Which captured CUDA graph runs a step: decode batches by sequence count, other steps by the smallest token
bucket whose sequence cap holds them, anything larger eagerly."""

from __future__ import annotations

from heron.executor.graph_keys import GraphKeys, is_decode


def test_default_limits():
    keys = GraphKeys.plan(max_num_seqs=256, max_num_batched_tokens=8192, prefill=True)
    assert keys.decode_sizes == [1, 2, 4, *range(8, 257, 8)]
    assert keys.prefill == [(16, 8), (32, 8), (64, 8), (128, 8), (256, 8), (512, 8)]
    every = keys.all()
    assert every == sorted(every, reverse=True) and every[0] == (512, 8) and every[-1] == (1, 1)
    assert len(every) == len(set(every)) == len(keys.decode_sizes) + len(keys.prefill)
    assert not any(is_decode(k) for k in keys.prefill)


def test_decode_steps_take_the_next_decode_size():
    keys = GraphKeys.plan(256, 8192, prefill=True)
    assert keys.for_step(1, 1, decode=True) == (1, 1)
    assert keys.for_step(3, 3, decode=True) == (4, 4)
    assert keys.for_step(8, 8, decode=True) == (8, 8)
    assert keys.for_step(9, 9, decode=True) == (16, 16)
    assert keys.for_step(256, 256, decode=True) == (256, 256)


def test_prefill_steps_take_the_smallest_bucket_that_holds_them():
    keys = GraphKeys.plan(256, 8192, prefill=True)
    assert keys.for_step(2, 1, decode=False) == (16, 8)
    assert keys.for_step(16, 1, decode=False) == (16, 8)  # exactly at a bucket
    assert keys.for_step(17, 1, decode=False) == (32, 8)
    assert keys.for_step(128, 1, decode=False) == (128, 8)
    assert keys.for_step(300, 3, decode=False) == (512, 8)
    assert keys.for_step(512, 8, decode=False) == (512, 8)
    assert keys.for_step(513, 1, decode=False) is None  # over the largest bucket: eager
    assert keys.for_step(40, 9, decode=False) is None  # over the sequence cap: eager


def test_small_max_num_batched_tokens_is_the_last_bucket():
    keys = GraphKeys.plan(256, 100, prefill=True)
    assert keys.prefill == [(16, 8), (32, 8), (64, 8), (100, 8)]
    assert keys.for_step(65, 2, decode=False) == (100, 8)
    assert keys.for_step(100, 2, decode=False) == (100, 8)
    assert GraphKeys.plan(256, 600, prefill=True).prefill[-1] == (512, 8)
    assert GraphKeys.plan(256, 512, prefill=True).prefill[-1] == (512, 8)


def test_tiny_limits_keep_prefill_keys_apart_from_decode_ones():
    """A step that is not a decode has a chunk of two tokens or more, so at most T - 1 sequences."""
    keys = GraphKeys.plan(max_num_seqs=8, max_num_batched_tokens=8, prefill=True)
    assert keys.decode_sizes == [1, 2, 4, 8] and keys.prefill == [(8, 7)]
    assert keys.for_step(8, 7, decode=False) == (8, 7)
    assert keys.for_step(8, 8, decode=True) == (8, 8)
    assert GraphKeys.plan(8, 1, prefill=True).prefill == []  # no step of two tokens fits
    # decode steps have at most max_num_batched_tokens sequences: no graph beyond that
    assert GraphKeys.plan(256, 20, prefill=False).decode_sizes == [1, 2, 4, 8, 16, 20]


def test_few_sequences_cap_the_prefill_graphs():
    keys = GraphKeys.plan(max_num_seqs=3, max_num_batched_tokens=2048, prefill=True)
    assert keys.decode_sizes == [1, 2, 3]
    assert all(seqs == 3 for _, seqs in keys.prefill)
    assert keys.for_step(20, 3, decode=False) == (32, 3)
    assert keys.for_step(3, 3, decode=True) == (3, 3)


def test_backends_without_prefill_graphs_and_no_graphs():
    keys = GraphKeys.plan(16, 8192, prefill=False)
    assert keys.prefill == [] and keys.for_step(20, 1, decode=False) is None
    assert keys.for_step(5, 5, decode=True) == (8, 8)
    none = GraphKeys([], [])  # before capture, on the CPU, or with enforce_eager
    assert none.for_step(1, 1, decode=True) is None and none.for_step(20, 1, decode=False) is None
    assert none.all() == []
