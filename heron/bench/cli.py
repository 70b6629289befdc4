"""`heron bench <benchmark>`: each benchmark is a module here with `add_cli_args(parser)` and `main(args)`;
adding one is one line in BENCHMARKS below. The engine and result options every benchmark shares are
defined once, in this file."""

from __future__ import annotations

import argparse
import importlib

from heron.bench.report import RESULTS_DIR

# subcommand -> module holding add_cli_args(parser) and main(args)
BENCHMARKS = {
    "throughput": "heron.bench.throughput",
    "latency": "heron.bench.latency",
    "serve": "heron.bench.serve",
}


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark Heron against transformers and the hardware",
                                  description="Benchmarks; each prints a table and, with --save-result, "
                                              "records benchmarks/results/<name>.json.")
    sub = bench.add_subparsers(dest="benchmark", metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip()
        parser = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main)
    bench.set_defaults(func=lambda args: bench.print_help() or 0)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--batch-size", type=int, default=256, dest="max_num_seqs", metavar="B",
                   help="sequences per step at most (the engine's max_num_seqs)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step at most (default: the engine's)")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB of KV cache (default: 2 on CPU, what --gpu-memory-utilization leaves on GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights in the shapes of --model's config.json (GPU benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0, help="the engine's seed and the workload's")


def add_result_args(parser: argparse.ArgumentParser, default_name: str) -> None:
    g = parser.add_argument_group("result")
    g.add_argument("--save-result", action="store_true",
                   help="write the result to <results-dir>/<result-name>.json")
    g.add_argument("--result-name", default=None, help=f"default: {default_name}")
    g.add_argument("--results-dir", default=RESULTS_DIR)


def make_llm(args: argparse.Namespace, **overrides):
    from heron import LLM

    kwargs = dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30),
                  gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
                  enforce_eager=args.enforce_eager, seed=args.seed, load_format=args.load_format,
                  max_model_len=args.max_model_len)
    kwargs.update(overrides)
    return LLM(**kwargs)


def model_slug(llm) -> str:
    """'SmolLM2-135M-Instruct' -> 'smollm2-135m-instruct': the model part of a default result name."""
    name = llm.engine.model_name.rstrip("/").split("/")[-1].removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name.lower())
