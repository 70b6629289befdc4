"""The LoRA slot pool: an adapter keeps its slot while held and after, until a new adapter needs the slot of
the least recently used one nobody holds; with every slot held, a new adapter waits."""

from __future__ import annotations

from heron.engine.lora_slots import LoRASlots
from heron.lora_request import LoRARequest


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_placements_are_loads_and_a_loaded_adapter_is_found_again():
    pool = LoRASlots(2)
    assert pool.acquire(_lora(1)) == 0 and pool.acquire(_lora(2)) == 1
    assert pool.take_loads() == [(0, _lora(1)), (1, _lora(2))]
    pool.release(0)
    assert pool.acquire(_lora(1)) == 0  # still there: no load
    assert pool.take_loads() == []


def test_the_least_recently_used_free_adapter_is_evicted_and_held_ones_never():
    pool = LoRASlots(2)
    pool.acquire(_lora(1)), pool.acquire(_lora(2))
    assert pool.acquire(_lora(3)) is None  # both held
    pool.release(1)
    pool.release(0)
    pool.acquire(_lora(2)), pool.release(1)  # 2 used after 1: 1 is the least recent
    pool.take_loads()
    assert pool.acquire(_lora(3)) == 0
    assert pool.take_loads() == [(0, _lora(3))]
    assert pool.acquire(_lora(2)) == 1 and pool.take_loads() == []


def test_a_fork_holds_the_slot_too():
    pool = LoRASlots(1)
    slot = pool.acquire(_lora(1))
    pool.retain(slot)
    pool.release(slot)
    assert pool.acquire(_lora(2)) is None
    pool.release(slot)
    assert pool.acquire(_lora(2)) == 0
