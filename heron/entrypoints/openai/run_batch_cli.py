"""`heron run-batch`'s flags, apart from run_batch.py so that `heron --help` imports neither torch nor the
server's modules (run_batch.py is imported when the command runs)."""

from __future__ import annotations

import argparse
import sys

from heron.entrypoints.engine_args import add_engine_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI Batch API file (JSONL) offline",
        description="Run an OpenAI Batch API file (JSONL) in-process, as `vllm run-batch` does "
        "(heron/entrypoints/openai/run_batch.py).",
    )
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, help="the results, one JSON object a line")
    p.add_argument("--resume", action="store_true", help="skip the custom_ids already in the output file")
    p.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: the embedded model)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names a line's body may give as its model, as `heron serve --served-model-name`",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads of the engine process when it runs on the CPU (as `heron serve --cpu-threads`)",
    )
    add_engine_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from heron.engine.async_llm import AsyncLLM
    from heron.engine.data_parallel import DataParallelAsyncLLM
    from heron.entrypoints.engine_args import engine_config
    from heron.entrypoints.openai.run_batch import resume_output, run_batch
    from heron.entrypoints.openai.server_config import engine_cpu_threads

    names = args.served_model_name
    config = engine_config(args, served_model_name=names[0] if names else None)
    engine_class = DataParallelAsyncLLM if config.parallel.data_parallel_size > 1 else AsyncLLM
    engine = engine_class.from_config(config, cpu_threads=engine_cpu_threads(args, config))
    done = resume_output(args.output_file) if args.resume else set()
    try:
        with open(args.output_file, "a" if args.resume else "w", encoding="utf-8") as out:
            summary = run_batch(engine, args.input_file, out, done, args.progress, names)
    finally:
        engine.shutdown()
    print(
        f"{summary.written} results written ({summary.errors} errors), {len(done)} skipped as already done",
        file=sys.stderr,
    )
    return 0
