"""The HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn on uvloop.

The socket opens at once and the model loads in a background thread, so /health answers 503 until it is
ready. SIGTERM / SIGINT stop accepting connections and give in-flight requests --shutdown-timeout seconds
to finish; a stream still running then ends with an error event and [DONE], a plain request with a 503;
then the engine stops and the server exits 0. If the engine dies, every request in flight gets an error at
once and the server exits 1, for its supervisor to restart it (as vLLM does).

Length: every route is here, each a few lines over its serving_* handler, so that the app reads as one table;
the start-up and shutdown sequence is the rest."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from swagger_ui_bundle import swagger_ui_path

from heron.config import EngineConfig
from heron.engine.async_llm import AsyncLLM, EngineDeadError, EngineStartError, RequestAbortedError
from heron.engine.data_parallel import DataParallelAsyncLLM
from heron.entrypoints.openai.admission import Admission
from heron.entrypoints.openai.errors import ApiError, api_error
from heron.entrypoints.openai.field_policy import refusal
from heron.entrypoints.openai.limits import RequestLimits
from heron.entrypoints.openai.middleware import ApiKeyMiddleware, BodyLimitMiddleware, InternalErrorMiddleware
from heron.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    request_fields,
)
from heron.entrypoints.openai.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from heron.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from heron.entrypoints.openai.server_config import api_keys, engine_cpu_threads, serve_engine_config
from heron.entrypoints.openai.serving_chat import OpenAIServingChat
from heron.entrypoints.openai.serving_completion import OpenAIServingCompletion
from heron.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from heron.entrypoints.openai.serving_engine import ClientDisconnected
from heron.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
)
from heron.entrypoints.openai.serving_responses import OpenAIServingResponses
from heron.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from heron.metrics import ServerMetrics, StatLogger
from heron.models.loader import EMBEDDED_NAME
from heron.version import __version__

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0
STREAM_GRACE_S = 5.0  # after --shutdown-timeout, for cut streams to send their error event before uvicorn cancels
LOADING_RETRY_AFTER_S = 5


@dataclass
class ServerState:
    """What the routes need; the engine and its serving objects appear once the model has loaded."""

    args: argparse.Namespace
    served_model_names: list[str]
    metrics: ServerMetrics
    admission: Admission
    stop: Callable[[int], None] = lambda exit_code: None  # ask the server to exit with this code (on the loop)
    engine: AsyncLLM | DataParallelAsyncLLM | None = None
    limits: RequestLimits | None = None
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    tokenization: OpenAIServingTokenization | None = None
    responses: OpenAIServingResponses | None = None
    embedding: OpenAIServingEmbedding | None = None
    models: OpenAIServingModels | None = None  # the base model's names and the LoRA adapters'
    loader: threading.Thread | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def attach(self, engine: AsyncLLM | DataParallelAsyncLLM, models: OpenAIServingModels) -> None:
        """On the event loop, once the model (and its --lora-modules adapters) have loaded."""
        self.limits = RequestLimits.of(engine.info, self.args.max_seqs_per_request)
        self.models = models
        common = dict(
            models=models,
            engine=engine,
            served_model_names=self.served_model_names,
            metrics=self.metrics,
            admission=self.admission,
            limits=self.limits,
            log_requests=self.args.enable_log_requests,
            scheduling_policy=self.args.scheduling_policy,
        )
        self.completion = OpenAIServingCompletion(**common)
        auto_tools = self.args.tool_call_parser if self.args.enable_auto_tool_choice else None
        self.chat = OpenAIServingChat(**common, tool_call_parser=auto_tools, response_role=self.args.response_role)
        self.tokenization = OpenAIServingTokenization(**common)
        self.responses = OpenAIServingResponses(**common, tool_call_parser=auto_tools)
        self.embedding = OpenAIServingEmbedding(**common)
        self.engine = engine
        loop = asyncio.get_running_loop()
        engine.on_dead(lambda error: loop.call_soon_threadsafe(self._engine_died, error))
        logger.info(
            "Model %s is ready (max_model_len %d): serving it as %s",
            engine.model_name,
            engine.max_model_len,
            ", ".join([*self.served_model_names, *models.lora_requests]),
        )

    def _engine_died(self, error: BaseException) -> None:
        logger.error("The engine has stopped (%s): exiting with code 1, for a supervisor to restart the server", error)
        self.stop(1)

    def abort_in_flight(self) -> None:
        """--shutdown-timeout has passed: end what still runs."""
        if self.engine is not None:
            self.engine.abort_all(
                f"The server is shutting down: requests still running after --shutdown-timeout "
                f"({self.args.shutdown_timeout:g} s) are aborted."
            )


router = APIRouter()


def _state(raw: Request) -> ServerState:
    return raw.app.state.server


def _ready(raw: Request) -> ServerState:
    s = _state(raw)
    if s.engine is None:
        raise ApiError(
            503,
            "The model is still loading; retry when /health answers 200.",
            code="model_loading",
            headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
        )
    if s.engine.dead is not None:
        raise api_error(EngineDeadError(f"the engine has stopped: {s.engine.dead!r}"))
    return s


def runner_mismatch(engine_runner: str, api: str, runner: str) -> ApiError | None:
    """A 400 that says which runner serves `api` when the engine's is not `runner` (as vLLM answers an
    endpoint its model does not support), else None."""
    if engine_runner == runner:
        return None
    how = (
        "for embeddings (--runner pooling): POST /v1/embeddings, or serve it without --runner pooling to generate"
        if runner == "generate"
        else "for generation: serve it with --runner pooling for embeddings"
    )
    return ApiError(400, f"The model does not support the {api}: this server runs it {how}.", param="model")


def _serving(raw: Request, api: str, runner: str = "generate") -> ServerState:
    """The state, once the model is loaded, if the engine's runner serves `api`."""
    s = _ready(raw)
    if (error := runner_mismatch(s.engine.info.runner, api, runner)) is not None:
        raise error
    return s


@router.get("/health", response_class=Response, responses={200: {"content": None}, 503: {"model": ErrorResponse}})
async def health(raw: Request) -> Response:
    """200 once the model is loaded and the engine runs; 503 before, and after the engine died. With
    data-parallel replicas, 200 while any serves, with a body saying which (`degraded` when some died: the
    server still answers, so a load balancer keeps it), and 503 once all have died."""
    s = _ready(raw)
    if not isinstance(s.engine, DataParallelAsyncLLM):
        return Response(status_code=200)
    alive = s.engine.health()
    status = "ok" if all(alive) else "degraded"
    return JSONResponse({"status": status, "replicas": [{"replica": i, "alive": a} for i, a in enumerate(alive)]})


@router.get("/ping", response_class=Response, responses={200: {"content": None}, 503: {"model": ErrorResponse}})
# SageMaker probes with POST; it takes no body, so the schema lists the GET only (a fuzzer has nothing to send).
@router.post("/ping", response_class=Response, include_in_schema=False)
async def ping(raw: Request) -> Response:
    """/health under SageMaker's name."""
    return await health(raw)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@router.get("/metrics", response_class=Response)
async def metrics(raw: Request) -> Response:
    """Prometheus text format."""
    return Response(_state(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(raw: Request) -> ModelList:
    """The base model's names, then the LoRA adapters (each with its `parent`)."""
    return ModelList(data=_cards(_ready(raw)))


@router.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorResponse}})
async def retrieve_model(model_id: str, raw: Request) -> ModelCard:
    """One served model; 404 in OpenAI's format for a name this server does not serve."""
    s = _ready(raw)
    s.models.model_name(model_id)
    return next(card for card in _cards(s) if card.id == model_id)


def _cards(s: ServerState) -> list[ModelCard]:
    # root: the model behind the name, for clients (heron bench serve) that need its tokenizer
    return s.models.cards(s.args.model or EMBEDDED_NAME, s.created, s.engine.max_model_len)


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


@router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
async def create_completion(body: CompletionRequest, raw: Request):
    """OpenAI's completions; with `stream`, server-sent events of the same objects."""
    return await _serving(raw, "Completions API").completion.create(body, raw)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    """OpenAI's chat completions; with `stream`, server-sent events of chat.completion.chunk objects."""
    return await _serving(raw, "Chat Completions API").chat.create(body, raw)


@router.post("/v1/responses", response_model=ResponseObject, responses=_ERRORS)
async def create_response(body: ResponsesRequest, raw: Request):
    """OpenAI's Responses API (text in, text out, nothing stored); with `stream`, its typed events."""
    return await _serving(raw, "Responses API").responses.create(body, raw)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
async def create_embedding(body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
    """OpenAI's embeddings, on a server started with --runner pooling."""
    return await _serving(raw, "Embeddings API", runner="pooling").embedding.create(body, raw)


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    return await _ready(raw).tokenization.tokenize(body)


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    return await _ready(raw).tokenization.detokenize(body)


def _runtime_lora(raw: Request) -> OpenAIServingModels:
    s = _ready(raw)
    if not s.args.allow_runtime_lora_updating:
        raise ApiError(
            404,
            "Loading and unloading LoRA adapters at runtime is off: start the server with "
            "--allow-runtime-lora-updating (or HERON_ALLOW_RUNTIME_LORA_UPDATING=1).",
            code="not_found",
        )
    return s.models


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """vLLM's: read a PEFT adapter and serve it under `lora_name` (with --allow-runtime-lora-updating)."""
    models = _runtime_lora(raw)
    return PlainTextResponse(await models.load_lora_adapter(body.lora_name, body.lora_path, None, body.load_inplace))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """vLLM's: stop serving the adapter `lora_name` (with --allow-runtime-lora-updating)."""
    return PlainTextResponse(await _runtime_lora(raw).unload_lora_adapter(body.lora_name))


def _root(request: Request) -> str:
    """The path prefix this server is reached under (--root-path), for the links its pages hold."""
    return request.scope.get("root_path", "").rstrip("/")


docs_router = APIRouter()  # /docs, with /openapi.json and /swagger-ui: absent with --disable-fastapi-docs


@docs_router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    # The assets come from this server (the swagger-ui-bundle package), so the page works offline.
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title=f"Heron {__version__} API",
        swagger_js_url=f"{root}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{root}/swagger-ui/favicon-32x32.png",
    )


PLAYGROUND = Path(__file__).with_name("static") / "playground.html"


@router.get("/playground", include_in_schema=False)
async def playground() -> HTMLResponse:
    """A chat page over /v1/chat/completions (one static file, no CDN: it works offline)."""
    return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))


@router.get("/", include_in_schema=False)
async def index(request: Request) -> HTMLResponse:
    root = _root(request)
    docs = f"<li><a href={root}/docs>API docs</a>" if request.app.openapi_url else ""
    return HTMLResponse(
        f"<!doctype html><meta charset=utf-8><title>Heron {__version__}</title>"
        f"<h1>Heron {__version__}</h1><ul><li><a href={root}/playground>Playground</a> (chat with the served "
        f"models){docs}<li><a href={root}/metrics>Metrics</a></ul>"
    )


_REQUEST_FIELDS = request_fields()


def _validation_param(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI writes `param` (`messages.[0].role`): field names and list
    indices, up to the first union-member tag pydantic inserts (`str`, `list[int]`) or dict key."""
    parts = []
    for x in loc[1:]:  # loc[0] is "body"
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif x in _REQUEST_FIELDS:
            parts.append(x)
        else:
            break
    return ".".join(parts) or None


def _unicode_error(value) -> str:
    """The message for text with a lone surrogate; `value` is that text, or a list or dict holding it."""
    texts = [value] if isinstance(value, str) else [str(v) for v in value]
    found = next(((t, i) for t in texts for i, c in enumerate(t) if "\ud800" <= c <= "\udfff"), None)
    where = f" ({found[0][found[1]]!r} at character {found[1]})" if found is not None else ""
    return (
        f"text must be valid Unicode, but holds a lone UTF-16 surrogate{where}: JSON writes a character "
        "beyond U+FFFF as a pair of escapes (\\ud83d\\ude00), and half of a pair is no character."
    )


def validation_error(errors: Sequence[dict]) -> ApiError:
    """A body its request model rejects, from pydantic's errors (located under "body", as FastAPI reports
    them): a 400 naming the field. Also what run-batch answers for such a line."""
    # Of a union's failed branches, the deepest says most (`Input should be 'text'`, not `... a string`);
    # text that is not Unicode says all.
    if extra := [x for x in errors if x["type"] == "extra_forbidden"]:
        loc = tuple(extra[0]["loc"])
        parent = _validation_param(loc[:-1])
        return ApiError(400, refusal(loc[-1]), param=f"{parent}.{loc[-1]}" if parent else loc[-1])
    unicode = [x for x in errors if x["type"] == "string_unicode"]
    err = unicode[0] if unicode else max(errors, key=lambda x: len(x["loc"]))
    if err["type"] == "json_invalid":
        why = err.get("ctx", {}).get("error", err["msg"])
        return ApiError(400, f"The body is not valid JSON: {why}")
    msg = _unicode_error(err["input"]) if err["type"] == "string_unicode" else err["msg"]
    param = _validation_param(tuple(err["loc"]))
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> Response:
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 413: "request_too_large"}.get(e.status_code)
        return ApiError(e.status_code, str(e.detail), code=code).response()

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestAbortedError)
    async def engine_error(_: Request, e: Exception) -> Response:
        return api_error(e).response()

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it

    # Anything else: InternalErrorMiddleware.


def build_app(args: argparse.Namespace, config: EngineConfig) -> FastAPI:
    names = args.served_model_name or [args.model or EMBEDDED_NAME]
    admission = Admission(args.max_waiting_requests)
    state = ServerState(
        args=args,
        served_model_names=names,
        metrics=ServerMetrics(
            names[0],
            lambda: state.engine.get_stats() if state.engine else None,
            lambda: admission.waiting,
            max_model_len=config.model.max_model_len or 1 << 17,
            cache_info={k: str(v) for k, v in asdict(config.cache).items()},
            compat=args.metrics_compat,
            max_lora=config.lora.max_loras if config.lora.enable_lora else None,
            replica_stats=(lambda: state.engine.replica_stats() if state.engine else [])
            if config.parallel.data_parallel_size > 1
            else None,
        ),
        admission=admission,
    )
    cpu_threads = engine_cpu_threads(args, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine_class = DataParallelAsyncLLM if config.parallel.data_parallel_size > 1 else AsyncLLM
                engine = engine_class.from_config(config, cpu_threads=cpu_threads)
                models = OpenAIServingModels(engine, names)
                for m in args.lora_modules or []:  # read and checked by the engine, on the loop
                    add = models.load_lora_adapter(m.name, m.path, m.base_model_name)
                    asyncio.run_coroutine_threadsafe(add, loop).result()
            except BaseException as e:  # noqa: BLE001 - reported, and the server exits
                if isinstance(e, ApiError):  # a --lora-modules adapter that cannot be served
                    logger.error("--lora-modules: %s", e.message)
                elif isinstance(e, EngineStartError):  # the engine process has logged the traceback: one line
                    logger.error("Could not load the model: %s", e)
                else:
                    logger.exception("Could not load the model")
                loop.call_soon_threadsafe(state.stop, 1)
                return
            try:
                loop.call_soon_threadsafe(state.attach, engine, models)
            except RuntimeError:  # the loop closed as the model finished loading: no one else stops the engine
                engine.shutdown()

        logger.info(
            "Loading model %s in the engine process: reading its weights, then sizing the KV cache (and capturing "
            "CUDA graphs on a GPU); /health answers 503 until it is ready",
            args.model or f"{EMBEDDED_NAME} (embedded)",
        )
        # A daemon thread, not the default executor: a server told to stop while loading need not wait.
        state.loader = threading.Thread(target=load, name="heron-load", daemon=True)
        state.loader.start()
        stats = None if args.disable_log_stats else asyncio.create_task(_log_stats(state))
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(
        title="Heron",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None if args.disable_fastapi_docs else "/openapi.json",
        description="OpenAI-compatible API of the Heron inference engine.",
    )
    app.state.server = state
    app.include_router(router)
    if not args.disable_fastapi_docs:
        app.include_router(docs_router)
        app.mount("/swagger-ui", StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")
    _install_error_handlers(app)
    app.openapi = lambda: _openapi(app, state)
    # Added innermost first: a request meets CORS, InternalErrorMiddleware, the key check, then the size.
    app.add_middleware(BodyLimitMiddleware, limit=args.max_request_body_bytes)
    keys = api_keys(args)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(InternalErrorMiddleware)
    # CORS outermost: a browser's preflight is answered before the key check, and every answer carries its headers
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    return app


def _openapi(app: FastAPI, state: ServerState) -> dict:
    """The schema, with the limits of the loaded model written in (kept once they are known)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    if state.limits is not None:
        state.limits.annotate(schema, state.served_model_names)
        app.openapi_schema = schema
    return schema


async def _log_stats(state: ServerState) -> None:
    stat_logger = StatLogger()
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        if state.engine is not None:
            stat_logger.log(state.engine.get_stats())


class _QuietStartupProbes(logging.Filter):
    """Drops the access lines of /health and /ping while the model loads: a supervisor probing every second
    would otherwise bury the start-up log under 503s."""

    PROBES = ("/health", "/ping")

    def __init__(self, state: ServerState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path, http version, status)
        args = record.args
        probe = isinstance(args, tuple) and len(args) >= 3 and args[2] in self.PROBES
        return not (probe and self.state.engine is None)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets=None) -> None:
        # uvicorn cancels what still runs at its own timeout, mid-write; ours comes first and ends each
        # request in the API's terms.
        deadline = asyncio.get_running_loop().call_later(self.state.args.shutdown_timeout, self.state.abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn announces only the sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            scheme = "https" if self.config.is_ssl else "http"
            url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
            logger.info("Listening on %s (CTRL+C to quit)", url)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal once it has shut down, which ends the process with 128 + signal; a
        # server that drained its requests as asked exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is an error at once, not after minutes of
    loading, with an engine process left running behind a server that never started."""
    # as uvicorn binds a socket it hands to workers: IPv6 for an address with a colon, else IPv4 (a host name
    # such as localhost resolves to its IPv4 address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings for the server (the proxy's --root-path; HTTPS with --ssl-keyfile and --ssl-certfile)."""
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + STREAM_GRACE_S,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = serve_engine_config(args)
    try:
        config.verify()
        if config.parallel.data_parallel_size > 1 and config.parallel.data_parallel_backend == "ray":
            from heron.engine.replica_launch import init_ray

            init_ray(config)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if args.ssl_keyfile and not args.ssl_certfile:
        logger.error("cannot serve HTTPS: --ssl-keyfile needs --ssl-certfile")
        return 2
    app = build_app(args, config)
    uv_config = uvicorn_config(app, args)
    try:  # the TLS files are read here: a bad one fails before the port is taken or the model loads
        uv_config.load()
    except OSError as e:
        logger.error("cannot serve HTTPS: %s", e)
        return 2
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        logger.error(
            "cannot listen on %s port %d: %s (another server there? --port picks another)",
            args.host,
            args.port,
            e.strerror or e,
        )
        return 1
    # The event loop holds the GIL most of the time under load; the thread that reads the engine's outputs
    # must not wait the default 5 ms for it at each step, or the engine's pipe fills and the engine waits.
    sys.setswitchinterval(0.001)
    state: ServerState = app.state.server
    server = _Server(uv_config, state)
    logging.getLogger("uvicorn.access").addFilter(_QuietStartupProbes(state))
    exit_code = 0

    def stop(code: int) -> None:
        nonlocal exit_code
        exit_code = max(exit_code, code)
        server.should_exit = True

    state.stop = stop
    try:
        server.run(sockets=[sock])
        code = 1 if not server.started else exit_code
    except SystemExit as e:  # uvicorn's own start-up failures end this way
        code = e.code if isinstance(e.code, int) else 1
    if state.loader is not None and state.loader.is_alive():
        # Stopped while loading: the loader is inside torch and cannot be interrupted, and finalizing the
        # interpreter under it aborts the process. Nothing is left to clean up, so leave at once.
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    # `python -m heron.entrypoints.openai.api_server --model ...`, as vLLM's module is run: `heron serve`.
    from heron.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
