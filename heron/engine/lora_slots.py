"""Which LoRA adapter sits in which of the device's `max_loras` slots: pure Python over ids.

A sequence holds a reference to its adapter's slot from its admission until it finishes or is preempted by
recompute (a swapped-out sequence keeps it). An adapter stays in its slot after its last user is gone, so
that the next request for it finds it loaded; a new adapter takes a free slot, else evicts the least
recently used adapter that nobody holds, else waits (the scheduler admits no more this step). Each new
placement is a load the next batch carries to the runner (`take_loads`).

It also knows which adapters have sequences running (holding a slot) and waiting (counted by the scheduler as
they enter and leave its waiting queue), for the server's `lora_requests_info` metric.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from heron.lora_request import LoRARequest


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.refs = [0] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self._loads: list[tuple[int, LoRARequest]] = []
        self.names: list[str] = [""] * num_slots  # the adapter's name in each slot
        self.waiting: Counter[str] = Counter()  # adapter name -> its sequences waiting for admission

    def acquire(self, lora: LoRARequest) -> int | None:
        """A reference to `lora`'s slot, placing it first if needed; None when every slot is held."""
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is None:
            if self.free:
                slot = self.free.pop()
            else:
                victim = next((i for i, s in self.slot_of.items() if self.refs[s] == 0), None)
                if victim is None:
                    return None
                slot = self.slot_of.pop(victim)
            self.slot_of[lora.lora_int_id] = slot
            self.names[slot] = lora.lora_name
            self._loads.append((slot, lora))
        self.slot_of.move_to_end(lora.lora_int_id)
        self.refs[slot] += 1
        return slot

    def retain(self, slot: int) -> None:
        """One more reference to a held slot (a forked sequence)."""
        self.refs[slot] += 1

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        assert self.refs[slot] >= 0, f"LoRA slot {slot} released twice"

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """The placements made since the last call, for the runner to load before its next forward."""
        loads, self._loads = self._loads, []
        return loads

    def count_waiting(self, lora: LoRARequest, change: int) -> None:
        """A sequence of `lora` entered (+1) or left (-1) the waiting queue."""
        self.waiting[lora.lora_name] += change
        if self.waiting[lora.lora_name] <= 0:
            del self.waiting[lora.lora_name]

    def running_adapters(self) -> list[str]:
        """The names of the adapters that running sequences hold."""
        return sorted({self.names[s] for s, n in enumerate(self.refs) if n})

    def waiting_adapters(self) -> list[str]:
        return sorted(self.waiting)
