"""A plain batch laid out for the device: token positions, host input ids (0 where the token is still on the
device), sampling rows (a forking draw gives one per sample) and prompt-logprob rows."""

from __future__ import annotations

import numpy as np

from heron.batch import SamplingSpec, ScheduledBatch
from heron.executor.step_layout import host_input_ids, prompt_logprob_rows, sampling_rows, token_layout
from heron.sampling_params import SamplingParams

ARANGE = np.arange(64)


def _batch(num_computed, num_tokens, num_samples, token_ids, num_prompt, prompt_logprobs=None) -> ScheduledBatch:
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    return ScheduledBatch(
        seq_ids=[10 + i for i in range(len(num_tokens))],
        num_tokens=num_tokens,
        num_computed=num_computed,
        num_samples=num_samples,
        token_ids=token_ids,
        block_tables=[[i] for i in range(len(num_tokens))],
        sampling=[SamplingSpec.of(params, 5, 0, p) for p in num_prompt],
        prompt_logprobs=[] if prompt_logprobs is None else list(range(len(num_tokens))),
    )


def test_a_decode_step_with_a_token_still_on_the_device():
    b = _batch([3, 4], [1, 1], [1, 1], [[1, 2, 3, 4], [5, 6, 7, 8]], [2, 2])  # the first one's 4th token is known
    t = token_layout(b.num_tokens, np.array(b.num_computed), ARANGE)
    assert t.decode and t.seq_lens.tolist() == [4, 5] and t.positions.tolist() == [3, 4]
    assert host_input_ids(b.token_ids, b.num_computed, t) == [4, 0]  # the second's 5th token is not


def test_a_mixed_step_with_a_chunk_ending_on_the_device():
    b = _batch([0, 4, 2], [3, 1, 3], [0, 1, 1], [[1, 2, 3, 4, 5], [5, 6, 7, 8, 9], [7, 8, 9, 10]], [5, 3, 4])
    t = token_layout(b.num_tokens, np.array(b.num_computed), ARANGE)
    assert not t.decode and t.qsl.tolist() == [0, 3, 4, 7] and t.positions.tolist() == [0, 1, 2, 4, 2, 3, 4]
    assert host_input_ids(b.token_ids, b.num_computed, t).tolist() == [1, 2, 3, 9, 9, 10, 0]


def test_sampling_rows_of_a_forking_draw():
    b = _batch([0, 7, 3], [4, 1, 1], [3, 0, 1], [[1, 2, 3, 4], [1] * 9, [1, 2, 3, 4]], [4, 9, 2])
    t = token_layout(b.num_tokens, np.array(b.num_computed), ARANGE)
    rows = sampling_rows(b, t.seq_lens, t.qsl)
    assert not rows.one_each and rows.seq_of_row == [0, 0, 0, 2] and rows.seq_ids == [10, None, None, 12]
    assert [s.index for s in rows.specs] == [0, 1, 2, 0] and rows.positions.tolist() == [0, 0, 0, 2]
    assert rows.token_index.tolist() == [3, 3, 3, 5]
    one = _batch([3, 2], [1, 1], [1, 1], [[1, 2, 3], [1, 2]], [2, 2])
    t = token_layout(one.num_tokens, np.array(one.num_computed), ARANGE)
    rows = sampling_rows(one, t.seq_lens, t.qsl)
    assert rows.one_each and rows.seq_ids is one.seq_ids and rows.token_index.tolist() == [0, 1]


def test_prompt_logprob_rows_score_the_next_prompt_token():
    b = _batch([0, 3], [3, 4], [0, 1], [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]], [5, 6], prompt_logprobs=2)
    t = token_layout(b.num_tokens, np.array(b.num_computed), ARANGE)
    p = prompt_logprob_rows(b, np.array(b.num_computed), t.seq_lens, t.qsl)
    # positions 0..2 of the first score its tokens 1..3; positions 3, 4 of the second its tokens 4, 5 (5 is its last)
    assert p.indices == [0, 1, 2, 3, 4] and p.targets == [2, 3, 4, 10, 11] and p.k == 2
    assert p.rows == [(0, 3, 2), (1, 2, 2)]
