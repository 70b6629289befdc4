"""`heron` command line (also `python -m heron`): `heron serve`, `heron generate`, `heron chat`, `heron bench ...`,
`heron run-batch`, `heron --version`.

Each subcommand lives beside the code it drives and registers itself here through `register(subparsers)`,
setting `func` on its parser."""

from __future__ import annotations

import argparse
import logging
import sys

from heron.entrypoints.config_sources import ConfigSourcesParser
from heron.version import __version__


def _register_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: embedded model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=_generate, command_parser=gen)


def _generate(args: argparse.Namespace) -> int:
    from heron.entrypoints.llm import LLM
    from heron.sampling_params import SamplingParams

    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from heron.bench import cli as bench_cli
    from heron.entrypoints import chat_cli
    from heron.entrypoints.openai import cli as serve_cli
    from heron.entrypoints.openai import run_batch_cli

    parser = argparse.ArgumentParser(prog="heron", description="Heron: LLM inference engine and server")
    parser.add_argument("--version", action="version", version=f"heron {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=ConfigSourcesParser)
    serve_cli.register(sub)
    _register_generate(sub)
    chat_cli.register(sub)
    bench_cli.register(sub)
    run_batch_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the usage of the sub-command they were given to, not heron's
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
