"""Engine configuration: one dataclass per concern, validated once, failing early with the field's name."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from heron.sampling_params import DEFAULT_MAX_LOGPROBS

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available.")
    return dev


def default_max_num_seqs(device: torch.device) -> int:
    """512 sequences on a GPU of 70 GiB or more other than an A100 (the GPUs vLLM gives a larger default), 256
    elsewhere. A step reads the weights and a shared prompt's K/V once for all its rows, so more rows a step
    pay where memory holds their KV: on an H100, 512 ran a job of 16 long system prompts x 32 requests 1.38x
    faster than 256, and 20,000 short requests 1.15x; vLLM's 1,024 ran the short requests 0.8x as fast as 256
    (BENCHMARKS.md; their steps then reach ~2,000 tokens, the largest mixed CUDA graph's size)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= 70 * 2**30 and "A100" not in props.name:
            return 512
    return 256


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (bf16 matmuls are slow there), bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass
class ModelSource:
    """A model in hand, wherever it came from (heron/models/loader.py makes one from a folder, a hub id or a GGUF
    file): the config.json dict, a lazy stream of (Hugging Face parameter name, tensor) pairs, the tokenizer and the
    generation defaults."""

    name: str  # what the server reports as the model id by default
    hf_config: dict
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    generation_config: dict = field(default_factory=dict)


POOLING_TYPES = ("LAST", "MEAN", "CLS")
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling"}


def resolve_runner(runner: str = "auto", task: str | None = None) -> str:
    """vLLM's --runner (auto, generate, pooling) and its older --task (generate, embed): the runner they mean.
    auto is "generate" (Heron's architectures are all causal LMs; an embedding model among them is asked
    for by name)."""
    if task is not None and task != "auto":
        if task not in _TASK_RUNNERS:
            raise ValueError(f"task must be one of auto, {', '.join(_TASK_RUNNERS)}; got {task!r}.")
        if runner not in ("auto", _TASK_RUNNERS[task]):
            raise ValueError(f"task {task!r} contradicts runner {runner!r}: give one of them.")
        return _TASK_RUNNERS[task]
    if runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner must be one of auto, generate, pooling; got {runner!r}.")
    return "generate" if runner == "auto" else runner


@dataclass
class PoolerConfig:
    """How a pooling model (runner "pooling") turns a prompt's final hidden states into one vector, as vLLM's
    --pooler-config: `pooling_type` LAST (the last token's; decoder embedding models such as Qwen3-Embedding),
    MEAN or CLS (the first token's); None: the model folder's sentence-transformers pooling, else LAST.
    `normalize`: L2-normalise the vector by default (a request's PoolingParams.normalize overrides it)."""

    pooling_type: str | None = None
    normalize: bool = True

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
        """From --pooler-config's JSON (or its dict); unknown keys are a ValueError naming them."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        import json

        d = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(d, dict) or (unknown := set(d) - {"pooling_type", "normalize"}):
            raise ValueError(f"pooler_config takes pooling_type and normalize only; got {sorted(unknown)}.")
        config = cls(**d)
        config.verify()
        return config

    def verify(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")


LOAD_FORMATS = ("auto", "safetensors", "dummy")
# The sampling parameters a model's generation config (and --override-generation-config) give requests by default
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


def is_hub_id(model: str | ModelSource | None) -> bool:
    """Whether the loader fetches `model` from the hub: a name that is neither a local folder nor a GGUF file."""
    return isinstance(model, str) and not model.endswith(".gguf") and not os.path.isdir(model)


@dataclass
class ModelConfig:
    model: str | ModelSource | None = None  # None: the embedded default; a ModelSource: tensors in hand
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # per token, a request's most; -1: the whole vocabulary
    chat_template: str | None = None
    served_model_name: str | None = None
    # "auto" | "safetensors" (the same for a folder or hub id: its *.safetensors; not a GGUF file) | "dummy"
    # (random weights in the checkpoint's shapes, for benchmarks)
    load_format: str = "auto"
    # A hub id's snapshot: its branch, tag or commit (`revision`; the tokenizer's own, when --tokenizer is another
    # hub id: `tokenizer_revision`), and the cache folder it is downloaded to (huggingface_hub's default: None)
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # "fp8": quantize a 16/32-bit checkpoint's projections to FP8 while loading (heron/models/quantization.py);
    # "awq" / "gptq" / "compressed-tensors": the checkpoint's own format, checked against its config.json;
    # None: as the checkpoint is (its config.json's quantization_config, if any)
    quantization: str | None = None
    # Default sampling parameters: "auto" the model's generation_config.json, "vllm" none (SamplingParams'
    # defaults), or a folder holding a generation_config.json; `override_generation_config` sets some of them
    # over that (vLLM's --override-generation-config)
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # "generate", or "pooling": every request is an embedding (prefill only, no decode; docs/server.md). vLLM's
    # older task="embed" means "pooling", task="generate" "generate".
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None  # runner "pooling": overrides what the model folder says

    def verify(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs!r}.")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}.")
        if self.pooler_config is not None:
            self.pooler_config.verify()
        if self.revision is not None and not is_hub_id(self.model):
            raise ValueError("revision picks a hub id's snapshot, and the model is a local one")
        if self.tokenizer_revision is not None and not is_hub_id(self.tokenizer or self.model):
            raise ValueError("tokenizer_revision picks a hub id's snapshot, and the tokenizer is a local one")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if self.quantization not in (None, "fp8", "awq", "gptq", "compressed-tensors"):
            raise ValueError(
                f"quantization must be 'fp8', 'awq', 'gptq', 'compressed-tensors' or None, got {self.quantization!r}."
            )
        if not isinstance(self.override_generation_config, dict | None):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}.")
        unknown = sorted(set(self.override_generation_config or {}) - set(GENERATION_DEFAULTS))
        if unknown:
            raise ValueError(
                f"override_generation_config: {', '.join(unknown)} cannot be set (the default sampling parameters "
                f"are {', '.join(GENERATION_DEFAULTS)})."
            )
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(self.generation_config, "generation_config.json")
        ):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                f"got {self.generation_config!r}."
            )


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The paged KV cache's element type: the model's, or float8 e4m3 (docs/quantization.md, "FP8 KV cache")."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; the budget on CPU (default 2 GiB), an override on GPU
    enable_prefix_caching: bool = True
    swap_space: float = 0.0  # GiB of host memory for swapped-out blocks; 0 = preempt by recompute
    # "auto": the model's dtype; "fp8" / "fp8_e4m3" (vLLM's names): float8 e4m3, per-tensor scales (the checkpoint's,
    # else 1.0)
    kv_cache_dtype: str = "auto"

    def verify(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {choices}; got {self.kv_cache_dtype!r}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int | None = None  # None: by device (default_max_num_seqs)
    max_num_batched_tokens: int | None = None  # None: 8192 on GPU, 2048 on CPU (at least max_num_seqs)
    policy: str = "fcfs"  # "fcfs" | "priority"
    max_model_len: int = 0  # filled from the model
    # vLLM's switch; prefills here are always chunked by max_num_batched_tokens, so only True (or unset) runs
    enable_chunked_prefill: bool | None = None

    def verify(self) -> None:
        if self.enable_chunked_prefill is False:
            raise ValueError(
                "enable_chunked_prefill: prefills are always chunked (by max_num_batched_tokens); it cannot be off."
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}.")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks (GPUs) each layer is split over; one process per rank
    # Engine replicas, each with its own tensor-parallel group, behind one router (heron/engine/data_parallel.py)
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"  # mp: local processes; ray: Ray actors (on a cluster: across its nodes)
    ray_address: str | None = None  # the cluster to join (None: RAY_ADDRESS, else a local Ray)

    def verify(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}.")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be mp or ray, got {self.data_parallel_backend!r}.")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: `max_loras` adapters at once on the device (a batch mixes them), each of rank up to
    `max_lora_rank`; `max_cpu_loras` adapters kept loaded in host memory (least recently used evicted)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def verify(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}).")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"
    attention_backend: str = "auto"  # "auto" | "torch" | "triton" | "flashinfer"
    enforce_eager: bool = False
    # Decode steps read a prefix shared by a group of sequences once for the group (cascade attention, the
    # Triton backend; heron/attention/cascade.py decides per step): True turns that off (vLLM's name).
    disable_cascade_attn: bool = False
    # On CUDA: time each projection's cuBLAS / cuBLASLt kernels at start-up and run the fastest (heron/kernels/
    # gemm); off: cuBLAS past the GEMV's rows. Ignored on the CPU.
    matmul_tuning: bool = True

    def verify(self) -> None:
        self.model.verify()
        self.cache.verify()
        self.scheduler.verify()
        self.parallel.verify()
        self.lora.verify()
        if self.cache.kv_cache_dtype != "auto" and self.attention_backend == "flashinfer":
            # FlashInfer's fp8 paged cache takes its scales in its plan; ours are wired into our own kernels only
            raise ValueError(
                f"kv_cache_dtype {self.cache.kv_cache_dtype!r} runs on the triton (GPU) or torch (CPU) attention "
                "backend, not flashinfer: pass attention_backend 'auto' or 'triton'."
            )
        if self.lora.enable_lora and self.parallel.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 yet.")
        if self.parallel.tensor_parallel_size > 1 and not isinstance(self.model.model, str | None):
            # each rank loads its own slices of the checkpoint, so it needs where to find it
            raise ValueError("tensor_parallel_size > 1 needs the model as a path or hub id, not tensors in hand.")
        if self.model.runner == "pooling" and (self.parallel.tensor_parallel_size > 1 or self.lora.enable_lora):
            raise ValueError("runner 'pooling' is not supported with tensor_parallel_size > 1 or enable_lora yet.")
