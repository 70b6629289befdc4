"""Heron: a high-throughput LLM inference engine with an OpenAI-compatible server."""

from heron.entrypoints.llm import LLM
from heron.lora_request import LoRARequest
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams
from heron.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
