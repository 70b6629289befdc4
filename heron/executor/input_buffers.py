"""One step's model and sampler inputs, in buffers that live as long as the runner: filled in place on
the host, copied to the device with one asynchronous copy per array. A captured CUDA graph reads the
same device addresses every step, and nothing is allocated per step.

On a GPU the host side is pinned memory, and there are two of them, used in turn (`flip`): the engine
prepares step t+1 while step t runs, and step t's copies may still be queued behind step t-1 then, so
the host must not overwrite what they read. (Copies from pageable memory would be worse than slow: CUDA
synchronises the stream before each one.) On the CPU host and device are one set of tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch


def _layout(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    return {
        "input_ids": ((max_tokens,), i64),
        "positions": ((max_tokens,), i64),
        "slot_mapping": ((max_tokens,), i64),
        "query_start_loc": ((max_seqs + 1,), i32),
        "seq_lens": ((max_seqs,), i32),
        "block_tables": ((max_seqs, max_blocks_per_seq), i32),
        "logits_indices": ((max_seqs + max_tokens,), i64),  # sampled rows, then prompt-logprob rows
        "prompt_lp_targets": ((max_tokens,), i64),
        "pending_dst": ((max_seqs,), i64),  # input positions whose token is the previous step's sample ...
        "pending_src": ((max_seqs,), i64),  # ... in this row of it
        "sampling_f32": ((3, max_seqs), f32),  # temperature, top_p, min_p
        "sampling_i64": ((3, max_seqs), i64),  # top_k, seed, counter
    }


def _batch_counts(num_tokens: int, num_seqs: int) -> dict[str, int]:
    return dict(input_ids=num_tokens, positions=num_tokens, slot_mapping=num_tokens, query_start_loc=num_seqs + 1,
                seq_lens=num_seqs, block_tables=num_seqs)


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        layout = _layout(max_tokens, max_seqs, max_blocks_per_seq)
        on_gpu = device.type == "cuda"
        self.dev = SimpleNamespace(**{k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in layout.items()})
        sides = [SimpleNamespace(**{k: torch.zeros(shape, dtype=dt, pin_memory=True) for k, (shape, dt) in
                                    layout.items()}) for _ in range(2)] if on_gpu else [self.dev]
        self._sides = [(side, SimpleNamespace(**{k: t.numpy() for k, t in vars(side).items()})) for side in sides]
        self._side = 0

    def flip(self) -> None:
        """Switch to the other host side (call once per step, before filling)."""
        self._side = (self._side + 1) % len(self._sides)

    @property
    def host(self) -> SimpleNamespace:
        """The current host side as torch tensors (for metadata read on the host)."""
        return self._sides[self._side][0]

    @property
    def np(self) -> SimpleNamespace:
        """The current host side as numpy arrays (for filling)."""
        return self._sides[self._side][1]

    def upload(self, **counts: int) -> None:
        """Copy the first counts[name] rows of each named array to the device (no-op on the CPU)."""
        if self.device.type != "cuda":
            return
        host = self.host
        for name, n in counts.items():
            getattr(self.dev, name)[:n].copy_(getattr(host, name)[:n], non_blocking=True)

    def upload_batch(self, num_tokens: int, num_seqs: int) -> None:
        """The model's and attention's inputs for `num_tokens` tokens of `num_seqs` sequences."""
        self.upload(**_batch_counts(num_tokens, num_seqs))

    def device_prefixes(self, num_tokens: int, num_seqs: int) -> list[torch.Tensor]:
        """The filled part of each device array of `upload_batch`: what the other tensor-parallel ranks
        receive of a step."""
        return [getattr(self.dev, name)[:n] for name, n in _batch_counts(num_tokens, num_seqs).items()]

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Rows num_seqs..padded of a captured decode graph: no keys, no cache write, harmless ids."""
        if padded == num_seqs:
            return
        h = self.np
        h.input_ids[num_seqs:padded] = 0
        h.positions[num_seqs:padded] = 0
        h.slot_mapping[num_seqs:padded] = -1
        h.seq_lens[num_seqs:padded] = 0
        h.query_start_loc[num_seqs + 1: padded + 1] = np.arange(num_seqs + 1, padded + 1)


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

    def gather(self, seqs: list, out: np.ndarray) -> None:
        """out[i] = block table of seqs[i] (`out` has at least len(seqs) rows)."""
        rows = [self._update(s, seqs) for s in seqs]
        np.take(self.table, rows, axis=0, out=out[: len(rows)])

    def _update(self, seq, batch: list) -> int:
        row = self.row_of.get(seq.seq_id)
        if row is None:
            row = self._new_row(seq.seq_id, batch)
        blocks = seq.block_table
        if self.lists[row] is not blocks:
            self.lists[row], self.written[row] = blocks, 0
        written = self.written[row]
        if len(blocks) > written:
            self.table[row, written: len(blocks)] = blocks[written:]
            self.written[row] = len(blocks)
        return row

    def _new_row(self, seq_id: int, batch: list) -> int:
        if not self.free:  # rows of sequences outside this batch are taken back (finished or preempted)
            live = {s.seq_id for s in batch}
            for row, owner in enumerate(self.seq_ids):
                if owner is not None and owner not in live:
                    del self.row_of[owner]
                    self.seq_ids[row], self.lists[row] = None, None
                    self.free.append(row)
        row = self.free.pop()
        self.row_of[seq_id], self.seq_ids[row] = row, seq_id
        return row
