"""`heron serve [MODEL]`: the flags, named as `vllm serve` names them, and the EngineConfig they make."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from heron.config import EngineConfig
from heron.entrypoints.engine_args import add_engine_args, engine_config


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models), with /health, /metrics, /tokenize, /detokenize, /version and Swagger UI "
        "at /docs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder, hub id or .gguf file; none: the embedded SmolLM2-135M-Instruct",
    )
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default=os.environ.get("HERON_HOST", "127.0.0.1"), help="address to listen on (env HERON_HOST)"
    )
    g.add_argument(
        "--port", type=int, default=int(os.environ.get("HERON_PORT", "8000")), help="port to listen on (env HERON_PORT)"
    )
    g.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize; several keys "
        "may be given (env HERON_API_KEY, comma-separated)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's names in the API; the first is reported (default: the model argument)",
    )
    g.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one, instead of the tokenizer's"
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 while this many accepted requests are still waiting for their first token (default: no limit)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds that in-flight requests get to finish before they are aborted",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt, parameters and output (never logged otherwise)",
    )


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags plus the server's own model-level ones (chat template, served names)."""
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    names = args.served_model_name
    return engine_config(args, chat_template=template, served_model_name=names[0] if names else None)


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("HERON_API_KEY", "").split(",") if k]
    return keys


def _serve(args: argparse.Namespace) -> int:
    from heron.entrypoints.openai.api_server import run_server

    return run_server(args)
