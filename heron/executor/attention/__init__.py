"""Attention backends behind one interface; `get_backend` picks one by name."""

from heron.executor.attention.backend import AttentionBackend, AttentionMetadata
from heron.executor.attention.torch_ref import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_backend_cls(name: str, device_type: str) -> type[AttentionBackend]:
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}.")
    return BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend_cls", "BACKENDS"]
