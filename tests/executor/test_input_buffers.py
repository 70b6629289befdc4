"""InputBuffers: one step's inputs packed in one buffer; BlockTables: the host copy of the scheduled sequences'
block tables that a step gathers its rows from."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from heron.executor.input_buffers import BlockTables, InputBuffers, pad_to_graph


def _seq(seq_id: int, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, block_table=blocks)


def _gather(tables: BlockTables, seqs: list[SimpleNamespace], out: np.ndarray, width: int) -> None:
    """A step's gather, with the columns a ScheduledBatch carries."""
    tables.gather([s.seq_id for s in seqs], [s.block_table for s in seqs], out, width)


def test_rows_follow_growth_replacement_and_reuse():
    tables = BlockTables(num_rows=3, max_blocks_per_seq=4)
    out = np.full((3, 4), -1, dtype=np.int32)
    a, b = _seq(0, [5]), _seq(1, [7, 8])
    _gather(tables, [a, b], out, 4)
    assert out[0, :1].tolist() == [5] and out[1, :2].tolist() == [7, 8]
    a.block_table.append(6)  # grows in place: only the new entry is written
    b.block_table = [9, 8]  # replaced (copy-on-write of a shared block): rewritten whole
    _gather(tables, [b, a], out, 2)
    assert out[0, :2].tolist() == [9, 8] and out[1, :2].tolist() == [5, 6]
    # more sequences than free rows: rows of sequences outside the batch are taken back
    c, d = _seq(2, [1]), _seq(3, [2, 3])
    _gather(tables, [c], out, 1)
    _gather(tables, [d, c], out, 2)
    assert out[0, :2].tolist() == [2, 3] and out[1, :1].tolist() == [1]
    out[0, 2:] = -1
    _gather(tables, [a], out, 2)  # `a` lost its row meanwhile: written again in full
    assert out[0].tolist() == [5, 6, -1, -1]  # only the blocks asked for are copied


def test_step_arrays_are_packed_views_whose_graph_inputs_stay_put():
    """A step's arrays are views into one buffer, none overlapping, in the prefix one copy moves; the arrays a
    captured graph reads sit at the same addresses whatever else the step holds."""
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=5, device=torch.device("cpu"))
    step = buffers.arrays(num_tokens=6, num_seqs=4, num_logits=3, num_targets=2)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in vars(step.dev).values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    assert all(start % 16 == 0 for start, _ in spans)  # Triton's aligned-pointer specialisation holds
    assert [
        len(t)
        for t in (
            step.dev.input_ids,
            step.dev.query_start_loc,
            step.dev.seq_lens,
            step.dev.block_tables,
            step.dev.logits_indices,
            step.dev.prompt_lp_targets,
        )
    ] == [6, 5, 4, 4, 3, 2]
    step.np.block_tables[3, 4] = 7  # the numpy, host and device views share memory (one buffer on the CPU)
    assert step.dev.block_tables[3, 4].item() == 7 and step.host.block_tables[3, 4].item() == 7
    base = step.shared.data_ptr()
    assert spans[0][0] >= base and step.dev.logits_indices.data_ptr() + 24 == base + step.shared.nbytes
    graph_inputs = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    other = buffers.arrays(num_tokens=6, num_seqs=6, num_logits=0, num_targets=0)
    again = buffers.arrays(num_tokens=6, num_seqs=6, num_logits=5, num_targets=1)
    assert [getattr(other.dev, k).data_ptr() for k in graph_inputs] == [
        getattr(again.dev, k).data_ptr() for k in graph_inputs
    ]


def _filled(buffers: InputBuffers, key: tuple[int, int], q_lens: list[int]) -> SimpleNamespace:
    """A step's real rows written as the runner writes them (ids 5, slots 9, one block each) into the arrays of
    the graph `key`, the padded rows first set to junk."""
    h = buffers.arrays(*key).np
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
        getattr(h, name)[:] = 77
    n, s = sum(q_lens), len(q_lens)
    h.query_start_loc[: s + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    h.seq_lens[:s] = q_lens
    h.input_ids[:n], h.positions[:n], h.slot_mapping[:n] = 5, 3, 9
    pad_to_graph(h, n, s, key)
    return h


def test_pad_to_a_prefill_graph():
    """Padded tokens: id 0, position 0, no cache write; padded sequences: no keys and no tokens (their
    query_start_loc stays at the real total, so neither attention kernel gives them a row)."""
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=5, device=torch.device("cpu"))
    h = _filled(buffers, (16, 4), [1, 6, 2])
    assert h.input_ids.tolist() == [5] * 9 + [0] * 7
    assert h.positions.tolist() == [3] * 9 + [0] * 7
    assert h.slot_mapping.tolist() == [9] * 9 + [-1] * 7
    assert h.seq_lens.tolist() == [1, 6, 2, 0]
    assert h.query_start_loc.tolist() == [0, 1, 7, 9, 9]
    full = _filled(buffers, (16, 4), [4, 4, 4, 4])  # nothing to pad
    assert full.query_start_loc.tolist() == [0, 4, 8, 12, 16] and full.slot_mapping.tolist() == [9] * 16


def test_pad_to_a_decode_graph():
    """A decode graph's padded sequence owns its padded row (row b is sequence b), with no keys."""
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks_per_seq=5, device=torch.device("cpu"))
    h = _filled(buffers, (4, 4), [1, 1])
    assert h.input_ids.tolist() == [5, 5, 0, 0] and h.slot_mapping.tolist() == [9, 9, -1, -1]
    assert h.seq_lens.tolist() == [1, 1, 0, 0]
    assert h.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    empty = _filled(buffers, (2, 2), [])  # what the capture runs: every row padded
    assert empty.query_start_loc.tolist() == [0, 1, 2] and empty.slot_mapping.tolist() == [-1, -1]
