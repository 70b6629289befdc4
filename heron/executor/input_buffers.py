"""One step's model and sampler inputs, packed into one buffer that lives as long as the runner: filled in
place on the host, copied to the device with a single asynchronous copy per step (each copy issued from
Python costs the host ~5-20 us on a GPU machine, and the device a small transfer of its own).

The buffer's start holds the arrays sized by max_num_seqs at fixed places (query_start_loc, seq_lens,
the pending-token indices, the sampling rows); the arrays sized by the step follow, packed for its
counts (`StepArrays`): input_ids, positions, slot_mapping and block_tables (for num_tokens, num_seqs),
then logits_indices and prompt_lp_targets. A step copies the prefix it filled. The places of the arrays a
captured graph reads depend only on its (num_tokens, num_seqs), so every replay of a graph finds its inputs
where the capture saw them, however many logits rows the step has; nothing is ever reallocated.

On a GPU the host side is pinned memory, and there are two of them, used in turn (`flip`): the engine
prepares step t+1 while step t runs, and step t's copy may still be queued behind step t-1 then, so
the host must not overwrite what it reads. (Copies from pageable memory would be worse than slow: CUDA
synchronises the stream before each one.) On the CPU host and device are one buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

_ALIGN = 256  # bytes; every array starts on it (Triton specialises kernels on 16-byte aligned pointers)
_MAX_CACHED = 1024  # step layouts whose views are kept (a decode batch size each, plus recent prefills)
_Layout = dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # name -> (byte offset, shape, dtype)


def _fixed_arrays(max_seqs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    return {
        "query_start_loc": ((max_seqs + 1,), i32),
        "seq_lens": ((max_seqs,), i32),
        "pending_dst": ((max_seqs,), i64),  # input positions whose token is the previous step's sample ...
        "pending_src": ((max_seqs,), i64),  # ... in this row of it
        "sampling_f32": ((3, max_seqs), f32),  # temperature, top_p, min_p
        "sampling_i64": ((3, max_seqs), i64),  # top_k, seed, counter
    }


def _step_arrays(
    num_tokens: int, num_seqs: int, width: int, num_logits: int, num_targets: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """In this order: what the model and attention read, then what the rank that samples reads (what
    tensor-parallel workers receive ends with logits_indices)."""
    i32, i64 = torch.int32, torch.int64
    return {
        "input_ids": ((num_tokens,), i64),
        "positions": ((num_tokens,), i64),
        "slot_mapping": ((num_tokens,), i64),
        "block_tables": ((num_seqs, width), i32),
        "logits_indices": ((num_logits,), i64),  # sampled rows, then prompt-logprob rows
        "prompt_lp_targets": ((num_targets,), i64),
    }


def _place(arrays: dict[str, tuple[tuple[int, ...], torch.dtype]], start: int) -> tuple[_Layout, int]:
    """Byte offsets for `arrays` one after another from `start`; returns them and the end."""
    layout = {}
    for name, (shape, dtype) in arrays.items():
        start = -(-start // _ALIGN) * _ALIGN
        layout[name] = (start, shape, dtype)
        start += math.prod(shape) * dtype.itemsize
    return layout, start


def _typed(flat: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
    """The bytes `flat` seen as each dtype the arrays use: an array is then one slice of one of them."""
    return {dtype: flat.view(dtype) for dtype in (torch.int32, torch.int64, torch.float32)}


def _view(typed: dict, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    """The array at byte `offset` of a buffer, from its `_typed` views (torch, or their numpy twins)."""
    start = offset // dtype.itemsize
    flat = typed[dtype][start : start + math.prod(shape)]
    return flat.reshape(shape) if len(shape) > 1 else flat


@dataclass
class StepArrays:
    """One step's arrays, as numpy on the host (`np`, for filling), as torch on the host (`host`, for
    backends that plan on the CPU) and on the device (`dev`). Rows past a step's counts are not there:
    query_start_loc has num_seqs + 1 entries, seq_lens num_seqs, and so on; the fixed arrays (pending
    indices, sampling rows) are whole."""

    num_tokens: int
    num_seqs: int
    np: SimpleNamespace
    host: SimpleNamespace  # query_start_loc, seq_lens and block_tables only
    dev: SimpleNamespace
    shared: torch.Tensor  # the device bytes tensor-parallel workers receive (through logits_indices)
    copy: tuple[torch.Tensor, torch.Tensor] | None  # (device, host) bytes of the step's one upload


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.width = max_blocks_per_seq
        self._fixed, self._fixed_end = _place(_fixed_arrays(max_seqs), 0)
        _, capacity = _place(
            _step_arrays(max_tokens, max_seqs, max_blocks_per_seq, max_seqs + max_tokens, max_tokens), self._fixed_end
        )
        capacity = -(-capacity // _ALIGN) * _ALIGN
        # Two host sides: one is filled while the other's step may still be read, its upload queued (or, on the
        # CPU, where a side is the step's memory itself, its sampling still to come: LLMEngine.advance).
        on_gpu = device.type == "cuda"
        self._hosts = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2)]
        self._dev = torch.zeros(capacity, dtype=torch.uint8, device=device) if on_gpu else None
        self._host_typed = [_typed(flat) for flat in self._hosts]
        self._dev_typed = None if self._dev is None else _typed(self._dev)
        self._np_typed = [{dtype: t.numpy() for dtype, t in typed.items()} for typed in self._host_typed]
        self._side = 0
        self._steps: dict[tuple[int, int, int, int], list[StepArrays]] = {}  # counts -> one per host side
        self._sampling_rows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def flip(self) -> None:
        """Switch to the other host side (call once per step, before filling)."""
        self._side = (self._side + 1) % len(self._hosts)

    def arrays(self, num_tokens: int, num_seqs: int, num_logits: int = 0, num_targets: int = 0) -> StepArrays:
        """The current host side's arrays for a step of these counts (views made once per counts)."""
        key = (num_tokens, num_seqs, num_logits, num_targets)
        sides = self._steps.get(key)
        if sides is None:
            if len(self._steps) >= _MAX_CACHED:
                self._steps.clear()
            sides = self._steps[key] = self._make(*key)
        return sides[self._side]

    def _make(self, num_tokens: int, num_seqs: int, num_logits: int, num_targets: int) -> list[StepArrays]:
        step, end = _place(_step_arrays(num_tokens, num_seqs, self.width, num_logits, num_targets), self._fixed_end)
        layout = self._fixed | step
        layout["query_start_loc"] = (layout["query_start_loc"][0], (num_seqs + 1,), torch.int32)
        layout["seq_lens"] = (layout["seq_lens"][0], (num_seqs,), torch.int32)
        shared_end = step["logits_indices"][0] + num_logits * 8
        planned = ("query_start_loc", "seq_lens", "block_tables")  # what backends plan from on the host
        sides = []
        for flat, typed, np_typed in zip(self._hosts, self._host_typed, self._np_typed):
            host = SimpleNamespace(**{k: _view(typed, *layout[k]) for k in planned})
            arrays = SimpleNamespace(**{k: _view(np_typed, *v) for k, v in layout.items()})
            dev_flat = flat if self._dev is None else self._dev
            dev_typed = typed if self._dev is None else self._dev_typed
            dev = SimpleNamespace(**{k: _view(dev_typed, *v) for k, v in layout.items()})
            copy = None if self._dev is None else (self._dev[:end], flat[:end])
            sides.append(StepArrays(num_tokens, num_seqs, arrays, host, dev, dev_flat[:shared_end], copy))
        return sides

    def upload(self, arrays: StepArrays) -> None:
        """Queue the step's one copy to the device (no-op on the CPU)."""
        if arrays.copy is not None:
            arrays.copy[0].copy_(arrays.copy[1], non_blocking=True)

    def sampling_rows(self, n: int, arrays: StepArrays) -> tuple[torch.Tensor, ...]:
        """Device views of the first n sampling rows: temperature, top_p, min_p, top_k, seed, counter."""
        f, i = arrays.dev.sampling_f32, arrays.dev.sampling_i64
        key = (n, f.data_ptr())  # (one device memory on a GPU; on the CPU, each side's own)
        rows = self._sampling_rows.get(key)
        if rows is None:
            rows = self._sampling_rows[key] = (f[0, :n], f[1, :n], f[2, :n], i[0, :n], i[1, :n], i[2, :n])
        return rows


def pad_to_graph(h: SimpleNamespace, num_tokens: int, num_seqs: int, key: tuple[int, ...]) -> None:
    """Fill the rows past a step's counts in the arrays `h` (numpy) of the captured graph `key` = (tokens,
    seqs, ...) that runs it: tokens with harmless ids and no cache write (slot -1), sequences with no keys. In a
    decode graph each padded sequence owns its padded row (the decode kernel reads row b as sequence b); in
    a prefill graph padded sequences own no rows (query_start_loc stays at the step's total), and the rows
    past it belong to no sequence."""
    tokens, seqs = key[:2]
    if tokens == num_tokens and seqs == num_seqs:  # a full decode batch, the common step
        return
    h.input_ids[num_tokens:tokens] = 0
    h.positions[num_tokens:tokens] = 0
    h.slot_mapping[num_tokens:tokens] = -1
    h.seq_lens[num_seqs:seqs] = 0
    h.query_start_loc[num_seqs : seqs + 1] = np.arange(num_tokens, tokens + 1) if tokens == seqs else num_tokens


class BlockTables:
    """Every scheduled sequence's block table, kept across steps in a host array with one row per
    sequence, so that a step copies only the blocks added since the last (block tables grow in place;
    a table the block manager replaced is rewritten whole), then gathers its batch's rows at once."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.seq_ids: list[int | None] = [None] * num_rows  # the sequence each row holds
        self.lists: list[list[int] | None] = [None] * num_rows  # its block table as last seen
        self.written = [0] * num_rows  # how many of its blocks the row holds
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free = list(range(num_rows - 1, -1, -1))

    def gather(self, seq_ids: list[int], tables: list[list[int]], out: np.ndarray, width: int) -> None:
        """out[i, :width] = the first `width` blocks of tables[i], the table of sequence seq_ids[i] (`out` has
        at least len(seq_ids) rows). `width`: the step's longest table; attention reads no block past a
        sequence's length, and copying whole rows would cost ~0.3 ms a step at 256 sequences of 2,560-block
        rows."""
        rows = [self._update(seq_id, blocks, seq_ids) for seq_id, blocks in zip(seq_ids, tables)]
        np.take(self.table[:, :width], rows, axis=0, out=out[: len(rows), :width])

    def _update(self, seq_id: int, blocks: list[int], batch: list[int]) -> int:
        row = self.row_of.get(seq_id)
        if row is None:
            row = self._new_row(seq_id, batch)
        if self.lists[row] is not blocks:
            self.lists[row], self.written[row] = blocks, 0
        written = self.written[row]
        if len(blocks) > written:
            self.table[row, written : len(blocks)] = blocks[written:]
            self.written[row] = len(blocks)
        return row

    def _new_row(self, seq_id: int, batch: list[int]) -> int:
        if not self.free:  # rows of sequences outside this batch are taken back (finished or preempted)
            live = set(batch)
            for row, owner in enumerate(self.seq_ids):
                if owner is not None and owner not in live:
                    del self.row_of[owner]
                    self.seq_ids[row], self.lists[row] = None, None
                    self.free.append(row)
        row = self.free.pop()
        self.row_of[seq_id], self.seq_ids[row] = row, seq_id
        return row
