"""`heron` command line: `heron serve`, `heron generate`, `heron bench ...`, `heron --version`."""

from __future__ import annotations

import argparse
import sys

from heron.version import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heron", description="Heron LLM inference engine")
    parser.add_argument("--version", action="version", version=f"heron {__version__}")
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    args = parser.parse_args(argv)
    if args.command == "generate":
        from heron import LLM, SamplingParams

        llm = LLM(args.model)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
        print(out[0].outputs[0].text)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
