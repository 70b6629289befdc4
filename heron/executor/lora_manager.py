"""The model runner's LoRA state: the slot stacks wrapped into the model, a host-side LRU of loaded adapters
(`max_cpu_loras`), and the per-token slot indices of each step.

The scheduler decides which adapter sits in which slot (heron/engine/lora_slots.py) and the batch carries the
loads to make (`lora_loads`) and each sequence's slot (`lora_slots`); this module makes the loads before the
forward (copies on the step's stream, so a step still running on the old weights finishes first) and writes
the step's per-token slots into one device buffer the stacks read.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from heron.config import EngineConfig, LoRAConfig
from heron.lora_request import LoRARequest
from heron.models.lora import LoRAAdapter, add_lora, load_adapter


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, max_tokens: int, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        # two host buffers used in turn: a step's copy may still be queued while the next one is filled
        self._host = [torch.full((max_tokens,), -1, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.stacks = add_lora(model, config.max_loras, config.max_lora_rank, self.token_slots)
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
        h[:n] = np.asarray(seq_slots, dtype=np.int64)[seq_of_token]
        h[n:num_rows] = -1
        self.token_slots[:num_rows].copy_(host[:num_rows], non_blocking=True)
