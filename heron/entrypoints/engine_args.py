"""The engine flags every command shares (`heron serve`, `heron bench ...`), named as vLLM names them, and
the EngineConfig they make."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from heron.sampling_params import DEFAULT_MAX_LOGPROBS, STRUCTURED_OUTPUTS_BACKENDS, check_structured_outputs_config

if TYPE_CHECKING:
    from heron.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="a tokenizer other than the model's")
    g.add_argument(
        "--tokenizer-mode",
        default="auto",
        choices=["auto"],
        help="vLLM's default mode, the one Heron has: the fast tokenizer where the model has one",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weights and activations; auto: float32 on CPU, bfloat16 on GPU",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of requests that give none (and of benchmark workloads)")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length, prompt and output together (default: the model's)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV cache",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV-cache size in bytes (default on CPU: 2 GiB; on GPU: from --gpu-memory-utilization)",
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of host memory for preempted sequences' blocks; 0: preempt by recomputing",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default="auto",
        help="the paged KV cache's element type: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3 with the "
        "checkpoint's per-tensor scales, else 1.0: about twice the tokens of a bf16 cache)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes",
    )
    g.add_argument(
        "--max-num-seqs",
        "--batch-size",
        type=int,
        default=None,
        help="sequences in one batch at most (default: 512 on a GPU of 70 GiB or more other than an A100, else 256; "
        "--batch-size: the benchmarks' name for it)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens in one step at most (default: 8192 on GPU, 2048 on CPU)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accepted for vLLM's command lines: prefills are always chunked by --max-num-batched-tokens (the "
        "--no- form is an error)",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: first come, first served; priority: lowest `priority` first, then arrival",
    )
    g.add_argument("--attention-backend", default="auto", help="auto, torch, triton or flashinfer")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--disable-cascade-attn",
        action="store_true",
        help="read a prefix that decoding sequences share once per sequence, not once per group",
    )
    g.add_argument(
        "--matmul-tuning",
        default="on",
        choices=["on", "off"],
        help="on CUDA, time each projection's cuBLAS/cuBLASLt kernels at start-up and run the fastest "
        "(off: cuBLAS past the decode GEMV's 16 rows)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split each layer over this many GPUs (one process per GPU; gloo over CPU processes)",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each with its own -tp GPUs, behind one prefix-cache-aware router (docs/scaling.md)",
    )
    g.add_argument(
        "--data-parallel-backend",
        choices=["mp", "ray"],
        default="mp",
        help="where the replicas run: mp, local processes; ray, Ray actors over a cluster's nodes",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster of --data-parallel-backend ray, as ray.init takes it (`auto`: the one this node "
        "joined; `local`: start a new one here; default: RAY_ADDRESS, else the one this node runs, else a new one)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: auto: the model's generation_config.json; vllm: none "
        "(SamplingParams' defaults); a folder: its generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help='default sampling parameters set over --generation-config\'s, as JSON: {"temperature": 0.5} '
        "(temperature, top_p, top_k, repetition_penalty)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help="the most logprobs a request may ask per token (logprobs, top_logprobs, prompt_logprobs); -1: the "
        "whole vocabulary",
    )
    g.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_config,
        default=None,
        help='vLLM\'s structured-outputs settings as JSON: {"backend": "xgrammar"} (or "auto"); xgrammar is '
        "Heron's one backend, and other settings are refused",
    )
    g.add_argument(
        "--guided-decoding-backend",
        choices=STRUCTURED_OUTPUTS_BACKENDS,
        default="auto",
        help="vLLM's older name for the structured-outputs backend: xgrammar, Heron's one",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; Heron runs only its own model code, never the model folder's",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],  # heron.config.LOAD_FORMATS (not imported: torch)
        help="auto and safetensors: a folder's or hub id's *.safetensors (auto also takes a .gguf file); dummy: "
        "random weights in the shapes of the model's config.json (benchmarks)",
    )
    g.add_argument("--revision", default=None, help="a hub id's branch, tag or commit to load")
    g.add_argument(
        "--tokenizer-revision",
        default=None,
        help="the revision of a hub tokenizer (--tokenizer, else the model's hub id)",
    )
    g.add_argument(
        "--download-dir",
        default=None,
        help="where a hub id is downloaded and looked up (default: huggingface_hub's cache, $HF_HOME)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8", "awq", "gptq", "compressed-tensors"],
        help="fp8: quantize a 16/32-bit checkpoint's projections to FP8 (e4m3) W8A8 while loading. A quantized "
        "checkpoint (FP8, AWQ, GPTQ, compressed-tensors) is read as its config.json says without this flag; "
        "with it, the flag must name the checkpoint's quant_method",
    )
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="pooling: run the model for embeddings (/v1/embeddings, LLM.embed), prefill only; auto: generate",
    )
    g.add_argument(
        "--task",
        default=None,
        choices=["auto", "generate", "embed"],
        help="vLLM's older spelling of --runner: embed is --runner pooling",
    )
    g.add_argument(
        "--pooler-config",
        "--override-pooler-config",
        default=None,
        help='with --runner pooling, JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true | false} '
        "(default: the folder's sentence-transformers pooling, else LAST; normalised)",
    )
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model (docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters on the device at once (one batch)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank accepted")
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="LoRA adapters kept in host memory (default: --max-loras)"
    )


def engine_config(args: argparse.Namespace, **model_extra) -> EngineConfig:
    """EngineConfig from the flags of add_engine_args; `model_extra` sets further ModelConfig fields."""
    from heron.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        PoolerConfig,
        SchedulerConfig,
        resolve_runner,
    )

    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            max_logprobs=args.max_logprobs,
            load_format=args.load_format,
            revision=args.revision,
            tokenizer_revision=args.tokenizer_revision,
            download_dir=args.download_dir,
            quantization=args.quantization,
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config,
            runner=resolve_runner(args.runner, args.task),
            pooler_config=PoolerConfig.parse(args.pooler_config),
            **model_extra,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            swap_space=args.swap_space,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
            enable_chunked_prefill=args.enable_chunked_prefill,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            data_parallel_backend=args.data_parallel_backend,
            ray_address=args.ray_address,
        ),
        lora=LoRAConfig(args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras),
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        disable_cascade_attn=args.disable_cascade_attn,
        matmul_tuning=args.matmul_tuning == "on",
    )


def json_flag(text: str) -> object:
    """A flag's value given as JSON (vLLM's form for objects and lists), or argparse's error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _structured_outputs_config(text: str) -> dict:
    """--structured-outputs-config: a JSON object that `check_structured_outputs_config` accepts."""
    value = _json_object(text)
    try:
        check_structured_outputs_config(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _json_object(text: str) -> dict:
    """A flag's JSON object (--override-generation-config)."""
    value = json_flag(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'a JSON object, like {{"temperature": 0.5}}, is wanted, got {text!r}')
    return value
