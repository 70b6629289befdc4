"""`heron bench <benchmark>`: each benchmark is a module here with `add_cli_args(parser)` and `main(args)`;
adding one is one line in BENCHMARKS below. The engine and result options every benchmark shares are
defined once, in this file."""

from __future__ import annotations

import argparse
import importlib

from heron.bench.report import RESULTS_DIR
from heron.entrypoints import engine_args

# subcommand -> module holding add_cli_args(parser) and main(args)
BENCHMARKS = {
    "throughput": "heron.bench.throughput",
    "latency": "heron.bench.latency",
    "serve": "heron.bench.serve",
}


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark Heron against transformers and the hardware",
        description="Benchmarks; each prints a table and, with --save-result, records benchmarks/results/<name>.json.",
    )
    sub = bench.add_subparsers(dest="benchmark", metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip()
        parser = sub.add_parser(
            name,
            help=doc.splitlines()[0] if doc else None,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main, command_parser=parser)
    bench.set_defaults(func=lambda args: bench.print_help() or 0)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model and the engine flags `heron serve` takes (heron/entrypoints/engine_args.py)."""
    parser.add_argument(
        "--model", default=None, help="HF folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    engine_args.add_engine_args(parser)


def add_result_args(parser: argparse.ArgumentParser, default_name: str) -> None:
    g = parser.add_argument_group("result")
    g.add_argument("--save-result", action="store_true", help="write the result to <results-dir>/<result-name>.json")
    g.add_argument("--result-name", default=None, help=f"default: {default_name}")
    g.add_argument("--results-dir", default=RESULTS_DIR)
    g.add_argument(
        "--gpu-monitor",
        action="store_true",
        help="sample GPU utilisation, memory, power and SM clock every 100 ms (NVML) into the result",
    )


def make_llm(args: argparse.Namespace):
    from heron.entrypoints.llm import LLM

    return LLM.from_config(engine_args.engine_config(args))


def model_slug(llm) -> str:
    """'SmolLM2-135M-Instruct' -> 'smollm2-135m-instruct': the model part of a default result name."""
    name = llm.engine.model_name.rstrip("/").split("/")[-1].removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name.lower())
