"""`heron serve [MODEL]`: the flags, named as `vllm serve` names them, and the EngineConfig they make."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from heron.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models), with /health, /metrics, /tokenize, /detokenize, /version and Swagger UI "
                    "at /docs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, hub id or .gguf file; none: the embedded SmolLM2-135M-Instruct")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=os.environ.get("HERON_HOST", "127.0.0.1"),
                   help="address to listen on (env HERON_HOST)")
    g.add_argument("--port", type=int, default=int(os.environ.get("HERON_PORT", "8000")),
                   help="port to listen on (env HERON_PORT)")
    g.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize; several keys "
                        "may be given (env HERON_API_KEY, comma-separated)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's names in the API; the first is reported (default: the model argument)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 while this many accepted requests are still waiting for their first token "
                        "(default: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds that in-flight requests get to finish before they are aborted")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt, parameters and output (never logged otherwise)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="a tokenizer other than the model's")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                   help="weights and activations; auto: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length, prompt and output together (default: the model's)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and the KV cache")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV-cache size in bytes (default on CPU: 2 GiB; on GPU: from --gpu-memory-utilization)")
    g.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for preempted sequences' blocks; 0: preempt by recomputing")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one step at most (default: 8192 on GPU, 2048 on CPU)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: first come, first served; priority: lowest `priority` first, then arrival")
    g.add_argument("--attention-backend", default="auto", help="auto, torch or triton")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights in the shapes of the model's config.json (benchmarks)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    names = args.served_model_name
    return EngineConfig(
        model=ModelConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                          max_model_len=args.max_model_len, seed=args.seed, chat_template=template,
                          served_model_name=names[0] if names else None, load_format=args.load_format),
        cache=CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
                          swap_space=args.swap_space),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.scheduling_policy),
        device=args.device, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("HERON_API_KEY", "").split(",") if k]
    return keys


def _serve(args: argparse.Namespace) -> int:
    from heron.entrypoints.openai.api_server import run_server

    return run_server(args)
