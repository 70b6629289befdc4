"""The model runner driven with plain ScheduledBatches, as the engine drives it: a step launched before the
previous one is read back takes the inputs that are not on the host yet (past a sequence's token_ids) from
that step's samples on the device, in order (a decode of the same batch) or scattered (any other step, a
chunk ending in such a token included), and samples what the same step samples with every token known."""

from __future__ import annotations

import numpy as np
import pytest

from heron import LLM, SamplingParams
from heron.batch import SamplingSpec, ScheduledBatch

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return LLM(tiny_model_dir("qwen3"), device="cpu", max_num_seqs=8, kv_cache_memory=64 << 20).engine.runner


def _batch(*seqs: tuple) -> ScheduledBatch:
    """seqs: (seq_id, token_ids, num_computed, num_tokens, block_table, num_samples, num_prompt_tokens)."""
    b = ScheduledBatch()
    for seq_id, tokens, computed, n, blocks, draws, num_prompt in seqs:
        b.seq_ids.append(seq_id)
        b.token_ids.append(tokens)
        b.num_computed.append(computed)
        b.num_tokens.append(n)
        b.block_tables.append(blocks)
        b.num_samples.append(draws)
        b.sampling.append(SamplingSpec.of(GREEDY, 0, 0, num_prompt))
    return b


def _prompts(*lengths: int) -> list[list[int]]:
    gen = np.random.default_rng(sum(lengths))
    return [gen.integers(2, 1000, n).tolist() for n in lengths]


def test_a_decode_of_the_previous_batch_takes_its_samples_in_order(runner):
    (p,) = _prompts(9)
    blocks = [0, 1]
    first = runner.execute(_batch((1, p, 0, 9, blocks, 1, 9)))
    second = runner.execute(_batch((1, p, 9, 1, blocks, 1, 9)))  # its input is `first`'s sample
    assert (second.inputs.num_pending, second.inputs.pending_in_order) == (1, True)
    got = first.result().sampled[0] + second.result().sampled[0]

    blocks = [2, 3]  # the same steps, each read back before the next
    [token] = runner.execute(_batch((2, p, 0, 9, blocks, 1, 9))).result().sampled[0]
    known = runner.execute(_batch((2, p + [token], 9, 1, blocks, 1, 9)))
    assert known.inputs.num_pending == 0
    assert got == [token] + known.result().sampled[0]


def test_other_steps_take_them_wherever_they_stand(runner):
    pa, pb, pc, pd = _prompts(5, 7, 6, 11)
    a, b, c, d, c_again = [4], [5], [6], [7, 8], [9]

    def second_step(ids: list[int], tokens: dict[str, list[int]]) -> ScheduledBatch:
        """b and a decode, d's prompt, and c computed again from the start (as after a preemption), its chunk
        ending in its sampled token; `tokens`: each sequence's tokens on the host."""
        return _batch(
            (ids[1], tokens["b"], 7, 1, b, 1, 7),
            (ids[3], tokens["d"], 0, 11, d, 1, 11),
            (ids[0], tokens["a"], 5, 1, a, 1, 5),
            (ids[2], tokens["c"], 0, 7, c_again, 1, 6),
        )

    def first_batch(ids: list[int]) -> ScheduledBatch:
        return _batch((ids[0], pa, 0, 5, a, 1, 5), (ids[1], pb, 0, 7, b, 1, 7), (ids[2], pc, 0, 6, c, 1, 6))

    ids = [10, 11, 12, 13]
    first = runner.execute(first_batch(ids))
    second = runner.execute(second_step(ids, {"a": pa, "b": pb, "c": pc, "d": pd}))
    assert (second.inputs.num_pending, second.inputs.pending_in_order) == (3, False)
    got = first.result().sampled, second.result().sampled

    ids = [20, 21, 22, 23]  # the same steps with every token on the host
    ta, tb, tc = runner.execute(first_batch(ids)).result().sampled
    known = runner.execute(second_step(ids, {"a": pa + ta, "b": pb + tb, "c": pc + tc, "d": pd}))
    assert known.inputs.num_pending == 0
    assert got == ([ta, tb, tc], known.result().sampled)


def test_a_forking_draw_samples_every_row_from_its_own_logits(runner):
    """One-token chunks: x is mid-prompt (no draw), y draws two (it forks): both rows are y's."""
    px, py = _prompts(4, 1)
    step = lambda draws: _batch((30, px, 0, 1, [10], 0, 4), (31, py, 0, 1, [11], draws, 1))
    [[], [y]] = runner.execute(step(1)).result().sampled
    assert runner.execute(step(2)).result().sampled == [[], [y, y]]
