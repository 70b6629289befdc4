"""Heron: a high-throughput LLM inference engine with an OpenAI-compatible server.

The public names are imported when first used (PEP 562), so that `heron --help` and other light commands
do not pay for torch."""

from heron.version import __version__

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "__version__",
]

_LAZY = {
    "LLM": "heron.entrypoints.llm",
    "LoRARequest": "heron.lora_request",
    "SamplingParams": "heron.sampling_params",
    "PoolingParams": "heron.pooling_params",
    "RequestOutput": "heron.outputs",
    "CompletionOutput": "heron.outputs",
    "EmbeddingRequestOutput": "heron.outputs",
    "Logprob": "heron.logprobs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'heron' has no attribute {name!r}")
