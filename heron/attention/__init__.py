"""Attention backends behind one interface; `get_backend` picks one by name."""

from heron.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from heron.attention.flashinfer_backend import FlashInferAttentionBackend
from heron.attention.torch_ref import TorchAttentionBackend
from heron.attention.triton_backend import TritonAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
    "flashinfer": FlashInferAttentionBackend,
}


def get_backend_cls(name: str, device_type: str) -> type[AttentionBackend]:
    """`auto`: our Triton kernels on a GPU, the PyTorch reference on the CPU. FlashInfer is only ever chosen by
    name: it is an optional dependency that JIT-compiles for minutes on first use, and it has not been measured
    faster than our kernels (`python -m heron.bench.kernels --vs-flashinfer` measures both)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}.")
    if name == "flashinfer" and device_type != "cuda":
        raise ValueError(f"attention_backend 'flashinfer' needs a CUDA device; got {device_type!r}.")
    return BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionParams", "get_backend_cls", "BACKENDS"]
