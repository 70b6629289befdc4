"""One step's model inputs, in buffers that live as long as the runner: filled in place on the host
(pinned, on GPU machines), copied to the device with one asynchronous copy per array. A captured CUDA
graph reads the same device addresses every step, and nothing is allocated per step."""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        on_gpu = device.type == "cuda"
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def pair(shape, dtype) -> tuple[np.ndarray, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
            dev = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else host
            self._pairs.append((host, dev))
            return host.numpy(), dev

        self.input_ids, self.input_ids_dev = pair(max_tokens, torch.int64)
        self.positions, self.positions_dev = pair(max_tokens, torch.int64)
        self.slot_mapping, self.slot_mapping_dev = pair(max_tokens, torch.int64)
        self.query_start_loc, self.query_start_loc_dev = pair(max_seqs + 1, torch.int32)
        self.seq_lens, self.seq_lens_dev = pair(max_seqs, torch.int32)
        self.block_tables, self.block_tables_dev = pair((max_seqs, max_blocks_per_seq), torch.int32)
        self.query_start_loc_host = self._pairs[3][0]
        self.seq_lens_host = self._pairs[4][0]

    def upload(self, num_tokens: int, num_seqs: int) -> None:
        """Copy the filled prefixes to the device (no-op on CPU, where both sides are one tensor)."""
        if self.device.type != "cuda":
            return
        for (host, dev), n in zip(self._pairs, self._filled(num_tokens, num_seqs)):
            dev[:n].copy_(host[:n], non_blocking=True)

    def device_prefixes(self, num_tokens: int, num_seqs: int) -> list[torch.Tensor]:
        """The filled part of each device array: what the other tensor-parallel ranks receive of a step."""
        return [dev[:n] for (_, dev), n in zip(self._pairs, self._filled(num_tokens, num_seqs))]

    @staticmethod
    def _filled(num_tokens: int, num_seqs: int) -> tuple[int, ...]:
        return num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Rows num_seqs..padded of a captured decode graph: no keys, no cache write, harmless ids."""
        if padded == num_seqs:
            return
        self.input_ids[num_seqs:padded] = 0
        self.positions[num_seqs:padded] = 0
        self.slot_mapping[num_seqs:padded] = -1
        self.seq_lens[num_seqs:padded] = 0
        self.query_start_loc[num_seqs + 1: padded + 1] = np.arange(num_seqs + 1, padded + 1)
