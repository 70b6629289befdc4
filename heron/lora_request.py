"""Which LoRA adapter a request runs with (vLLM's `LoRARequest`): a shared data type, since the entrypoints
name it, the engine schedules by it and the executor loads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) under a name and a
    positive integer id: the id is the adapter's identity (its slot, its prefix-cache key), the name is what
    the server shows."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}.")
