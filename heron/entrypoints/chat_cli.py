"""`heron chat`: a REPL over the offline `LLM`, as `vllm chat` is over a server: each line read from stdin is
the user's turn, the model's answer is printed, and the conversation goes on until end of input (or
`/exit`). Piped input works the same (one turn per line)."""

from __future__ import annotations

import argparse
import sys


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags, named as SamplingParams' fields."""
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)


def register(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a model offline (a REPL over stdin)")
    chat.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: embedded model)")
    chat.add_argument("--system-prompt", default=None)
    add_sampling_args(chat)
    chat.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from heron.entrypoints.llm import LLM

    llm = LLM(args.model)
    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "seed") if getattr(args, k) is not None}
    params = replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens, **given)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
