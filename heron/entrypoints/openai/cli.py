"""`heron serve [MODEL]`: the flags, named as `vllm serve` names them (server_config.py reads them)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from heron.entrypoints.engine_args import add_engine_args, json_flag
from heron.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST
from heron.entrypoints.openai.tool_parsers import TOOL_PARSERS
from heron.metrics import COMPAT_PREFIXES


def register(subparsers) -> None:
    p = subparsers.add_parser(  # a ConfigSourcesParser (heron/entrypoints/cli.py): flags also from env and --config
        "serve",
        env_prefix="HERON_",
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
    p.add_argument("--model", dest="model_option", default=None, help="the model, as a flag (vLLM's older habit)")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=_serve, command_parser=p)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves this server under (the proxy strips it; the OpenAPI schema, "
        "/docs and the pages link through it)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked against")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="whether a client certificate is required, as Python's ssl module numbers it (0 none, 1 optional, "
        "2 required)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_strings,
        default=["*"],
        help='CORS: the origins whose web pages may call the API, a JSON list (["*"]: any, as vLLM allows)',
    )
    g.add_argument(
        "--allowed-methods", type=_json_strings, default=["*"], help="CORS: the methods allowed, a JSON list"
    )
    g.add_argument(
        "--allowed-headers", type=_json_strings, default=["*"], help="CORS: the headers allowed, a JSON list"
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let web pages send cookies and HTTP authentication",
    )
    g.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize; several keys "
        "may be given, and the keys of HERON_API_KEY (comma-separated) and --config are accepted too",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's names in the API; the first is reported (default: the model argument)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters to serve (with --enable-lora), each as name=path or as vLLM\'s JSON {"name": ..., '
        '"path": ..., "base_model_name": ...}; a request picks one by its model field (docs/lora.md)',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); they are behind --api-key like every /v1/ route",
    )
    g.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one, instead of the tokenizer's"
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="the role of a chat answer that follows the generation prompt (request's add_generation_prompt); "
        "without one, an answer takes the last message's role",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose its tool calls (tool_choice "auto", the default with tools); needs '
        "--tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.x), mistral",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=_positive,
        default=None,
        help="answer 503 (with Retry-After) while this many accepted prompts, over all endpoints, are still "
        "waiting for their first token (default: no limit)",
    )
    g.add_argument(
        "--max-seqs-per-request",
        type=_positive,
        default=DEFAULT_MAX_SEQS_PER_REQUEST,
        help="prompts x n that one request may ask for (400 beyond); n is also at most --max-num-seqs",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="answer 413 to a larger request body, without reading the rest of it",
    )
    g.add_argument(
        "--cpu-threads",
        type=_positive,
        default=None,
        help="torch threads of the engine process when it runs on the CPU (default: $OMP_NUM_THREADS if set, "
        "else min(4, cores - 1), leaving a core to the HTTP side)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds that in-flight requests get to finish; then a stream ends with an "
        "error event and [DONE], a plain request with 503",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    g.add_argument(
        "--metrics-compat",
        choices=sorted(COMPAT_PREFIXES),
        default=None,
        help="/metrics also exports every heron: metric under this server's names (vllm: vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, ... for dashboards and gateways made for vLLM)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt, parameters and output (never logged otherwise)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_false",
        dest="enable_log_requests",
        help="do not log requests (the default; vLLM's older flag)",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine statistics in the log")
    g.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /openapi.json, /docs or its /swagger-ui assets",
    )


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's name): an adapter's name in the API, its PEFT folder, and the base
    model it adapts as /v1/models shows it (`parent`; None: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (argparse's type)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(
                f'{text!r}: expected {{"name": ..., "path": ..., "base_model_name": ...}} ({e!r})'
            ) from None
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


def _json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for the CORS lists)."""
    value = json_flag(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'a JSON list of strings, like ["*"], is wanted, got {text!r}')
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def resolve_model(args: argparse.Namespace) -> None:
    """The model comes as the positional argument or as --model, not both."""
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            args.command_parser.error(f"the model is given twice: {args.model!r} and --model {args.model_option!r}")
        args.model = args.model_option


def _serve(args: argparse.Namespace) -> int:
    from heron.entrypoints.openai.api_server import run_server

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("heron serve: --enable-auto-tool-choice requires --tool-call-parser")
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("heron serve: --lora-modules requires --enable-lora")

    resolve_model(args)
    return run_server(args)
