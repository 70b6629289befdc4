"""BlockTables: the host copy of the scheduled sequences' block tables that a step gathers its rows from."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from heron.executor.input_buffers import BlockTables


def _seq(seq_id: int, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, block_table=blocks)


def test_rows_follow_growth_replacement_and_reuse():
    tables = BlockTables(num_rows=3, max_blocks_per_seq=4)
    out = np.full((3, 4), -1, dtype=np.int32)
    a, b = _seq(0, [5]), _seq(1, [7, 8])
    tables.gather([a, b], out)
    assert out[0, :1].tolist() == [5] and out[1, :2].tolist() == [7, 8]
    a.block_table.append(6)  # grows in place: only the new entry is written
    b.block_table = [9, 8]  # replaced (copy-on-write of a shared block): rewritten whole
    tables.gather([b, a], out)
    assert out[0, :2].tolist() == [9, 8] and out[1, :2].tolist() == [5, 6]
    # more sequences than free rows: rows of sequences outside the batch are taken back
    c, d = _seq(2, [1]), _seq(3, [2, 3])
    tables.gather([c], out)
    tables.gather([d, c], out)
    assert out[0, :2].tolist() == [2, 3] and out[1, :1].tolist() == [1]
    tables.gather([a], out)  # `a` lost its row meanwhile: written again in full
    assert out[0, :2].tolist() == [5, 6]
