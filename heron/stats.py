"""The engine's counters and gauges, a plain dataclass that the engine fills and the serving side reads (the
metrics endpoint, the periodic log line), so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since start and gauges now."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0  # the KV cache's size, for cache_config_info
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    # With enable_lora: the names of the adapters with sequences running, and with sequences waiting
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
