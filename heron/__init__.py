"""Heron: a high-throughput LLM inference engine with an OpenAI-compatible server."""

from heron.entrypoints.llm import LLM
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams
from heron.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
