"""The model runner's LoRA state: the slot stacks wrapped into the model, a host-side LRU of loaded adapters
(`max_cpu_loras`), and the per-token slot indices of each step.

The scheduler decides which adapter sits in which slot (heron/engine/lora_slots.py) and the batch carries the
loads to make (`lora_loads`) and each sequence's slot (`lora_slots`); this module makes the loads before the
forward (copies on the step's stream, so a step still running on the old weights finishes first) and writes
the step's per-token slots into the device buffers the stacks read (`LoRAMapping`; on CUDA also the rows
grouped by slot, for the gathered kernel: a stable sort of at most max_num_batched_tokens small integers per step).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from heron.config import EngineConfig, LoRAConfig
from heron.layers.lora import LoRAMapping
from heron.lora_request import LoRARequest
from heron.models.lora import LoRAAdapter, add_lora, load_adapter


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, max_tokens: int, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.gathered = device.type == "cuda"  # the kernel, which reads the rows grouped by slot
        # [token_slots | sorted_tokens | slot_start], on the device and twice on the host, used in turn: a step's
        # copy may still be queued while the next one is filled
        size = 2 * max_tokens + config.max_loras + 1
        self._device = torch.full((size,), -1, dtype=torch.long, device=device)
        # before any step's prepare (the start-up's profiling and compile steps): every row the base model's, as
        # prepare would list them; the kernel that applies gate/up's delta inside the activation reads every row
        base = group_by_slot(np.full(max_tokens, -1), config.max_loras)
        self._device[max_tokens:].copy_(torch.from_numpy(np.concatenate(base)))
        self._host = [torch.full((size,), -1, dtype=torch.long, pin_memory=self.gathered) for _ in range(2)]
        self._max_tokens = max_tokens
        d = self._device
        self.mapping = LoRAMapping(d[:max_tokens], d[max_tokens : 2 * max_tokens], d[2 * max_tokens :])
        self.token_slots = self.mapping.token_slots
        self.stacks = add_lora(model, config.max_loras, config.max_lora_rank, self.mapping)
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first

    @classmethod
    def build(cls, model: torch.nn.Module, config: EngineConfig, device: torch.device) -> LoRAManager | None:
        """The manager of an engine with `enable_lora` (steps of up to max_num_batched_tokens rows), else None."""
        if not config.lora.enable_lora:
            return None
        return cls(model, config.lora, config.scheduler.max_num_batched_tokens, device)

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, from the host cache or read (and checked) now; raises ValueError for a bad one."""
        adapter = self.cpu_cache.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(lora.lora_name, lora.lora_path, self.stacks, self.config.max_lora_rank)
            self.cpu_cache[lora.lora_int_id] = adapter
            while len(self.cpu_cache) > self.config.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(lora.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter read earlier (a server unloading it); False if it was not held."""
        return self.cpu_cache.pop(lora_int_id, None) is not None

    def load(self, slot: int, lora: LoRARequest) -> None:
        """Put `lora` into device slot `slot` (every projection: zero where the adapter has no matrix)."""
        adapter = self.get(lora)
        for key, stack in self.stacks.items():
            weights = adapter.weights.get(key)
            if weights is None:
                stack.lora_a[slot].zero_()
                stack.lora_b[slot].zero_()
            else:
                stack.set_slot(slot, *weights)

    def prepare(
        self, loads: list[tuple[int, LoRARequest]], seq_slots: list[int], seq_of_token: np.ndarray, num_rows: int
    ) -> None:
        """Before a step's forward: make its loads, then set each of its `num_rows` token rows (padded past
        the real tokens with the base model's -1) to its sequence's slot."""
        for slot, lora in loads:
            self.load(slot, lora)
        self._host.reverse()
        host = self._host[0]
        h = host.numpy()
        n = len(seq_of_token)
        slots = h[:num_rows]
        slots[:n] = np.asarray(seq_slots, dtype=np.int64)[seq_of_token]
        slots[n:] = -1
        self.token_slots[:num_rows].copy_(host[:num_rows], non_blocking=True)
        if self.gathered:
            mt = self._max_tokens
            h[mt : mt + num_rows], h[2 * mt :] = group_by_slot(slots, self.config.max_loras)
            self.mapping.sorted_tokens[:num_rows].copy_(host[mt : mt + num_rows], non_blocking=True)
            self.mapping.slot_start.copy_(host[2 * mt :], non_blocking=True)


def group_by_slot(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row, those with a slot (>= 0) first, grouped by slot, in order within each, then the base model's
    (-1), and each slot's start in that list ([num_slots + 1]; the last is where the base model's rows begin):
    the gathered kernels' `sorted_tokens` and `slot_start`. (Only the kernel that also applies a gated MLP's
    activation reads the base model's rows: it writes every row.)"""
    order = np.argsort(np.where(token_slots < 0, num_slots, token_slots), kind="stable")
    starts = np.zeros(num_slots + 1, dtype=np.int64)
    np.cumsum(np.bincount(token_slots[token_slots >= 0], minlength=num_slots), out=starts[1:])
    return order, starts
