"""The HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn on uvloop.

The socket opens at once and the model loads in a background thread, so /health answers 503 until it is
ready (and again if the engine dies). SIGTERM / SIGINT stop accepting connections, give in-flight requests
--shutdown-timeout seconds to finish, then stop the engine and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from swagger_ui_bundle import swagger_ui_path

from heron.config import EngineConfig
from heron.engine.async_llm import AsyncLLM, EngineDeadError
from heron.entrypoints.openai.cli import api_keys, serve_engine_config
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
)
from heron.entrypoints.openai.serving_chat import OpenAIServingChat
from heron.entrypoints.openai.serving_completion import OpenAIServingCompletion
from heron.entrypoints.openai.serving_engine import ApiError, ClientDisconnected
from heron.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from heron.metrics import ServerMetrics, StatLogger
from heron.models.loader import EMBEDDED_NAME
from heron.version import __version__

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerState:
    """What the routes need; the engine and its serving objects appear once the model has loaded."""

    args: argparse.Namespace
    served_model_names: list[str]
    metrics: ServerMetrics
    on_load_failure: Callable[[], None] = lambda: None
    engine: AsyncLLM | None = None
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    tokenization: OpenAIServingTokenization | None = None
    loader: threading.Thread | None = None
    load_error: BaseException | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def attach(self, engine: AsyncLLM) -> None:
        common = dict(
            engine=engine,
            served_model_names=self.served_model_names,
            metrics=self.metrics,
            max_waiting_requests=self.args.max_waiting_requests,
            log_requests=self.args.enable_log_requests,
        )
        self.completion = OpenAIServingCompletion(**common)
        self.chat = OpenAIServingChat(**common)
        self.tokenization = OpenAIServingTokenization(**common)
        self.engine = engine
        logger.info(
            "Model %s is ready (max_model_len %d): serving it as %s",
            engine.model_name,
            engine.max_model_len,
            ", ".join(self.served_model_names),
        )


router = APIRouter()


def _state(raw: Request) -> ServerState:
    return raw.app.state.server


def _ready(raw: Request) -> ServerState:
    s = _state(raw)
    if s.engine is None:
        raise ApiError(503, "The model is still loading; retry when /health answers 200.", code="model_loading")
    if s.engine.dead is not None:
        raise ApiError(503, f"The engine has stopped: {s.engine.dead!r}", code="engine_dead")
    return s


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(raw: Request) -> Response:
    """200 once the model is loaded and the engine runs; 503 before, and after the engine died."""
    _ready(raw)
    return Response(status_code=200)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@router.get("/metrics", response_class=Response)
async def metrics(raw: Request) -> Response:
    """Prometheus text format."""
    return Response(_state(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(raw: Request) -> ModelList:
    s = _ready(raw)
    return ModelList(
        data=[
            ModelCard(id=name, created=s.created, max_model_len=s.engine.max_model_len) for name in s.served_model_names
        ]
    )


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


@router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
async def create_completion(body: CompletionRequest, raw: Request):
    """OpenAI's completions; with `stream`, server-sent events of the same objects."""
    return await _ready(raw).completion.create(body, raw)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    """OpenAI's chat completions; with `stream`, server-sent events of chat.completion.chunk objects."""
    return await _ready(raw).chat.create(body, raw)


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    return _ready(raw).tokenization.tokenize(body)


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    return _ready(raw).tokenization.detokenize(body)


@router.get("/docs", include_in_schema=False)
async def swagger_ui() -> HTMLResponse:
    # The assets come from this server (the swagger-ui-bundle package), so the page works offline.
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title=f"Heron {__version__} API",
        swagger_js_url="/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url="/swagger-ui/swagger-ui.css",
        swagger_favicon_url="/swagger-ui/favicon-32x32.png",
    )


class ApiKeyMiddleware:
    """Bearer-key check on the model's routes (/health, /metrics and the docs stay open). Every key is
    compared in constant time, so neither a key's prefix nor which key matched leaks through timing."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            given = token.strip().encode() if scheme.lower() == "bearer" else b""
            ok = False
            for key in self.keys:
                ok |= hmac.compare_digest(given, key)
            if not ok:
                msg = "Incorrect API key provided." if given else "Missing API key: send `Authorization: Bearer KEY`."
                await ApiError(401, msg, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_param(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI writes `param` (`messages.[0].role`), without the union-member
    tags pydantic inserts (`str`, `list[int]`, class names)."""
    parts = []
    for x in loc[1:]:  # loc[0] is "body"
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif x.isidentifier() and x.islower() and x not in ("str", "int", "float", "bool", "list", "dict"):
            parts.append(x)
        else:
            break
    return ".".join(parts) or None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> Response:
        # Of a union's failed branches, the deepest says most (`Input should be 'text'`, not `... a string`).
        err = max(e.errors(), key=lambda err: len(err["loc"]))
        if err["type"] == "json_invalid":
            why = err.get("ctx", {}).get("error", err["msg"])
            return ApiError(400, f"The body is not valid JSON: {why}").response()
        param = _validation_param(tuple(err["loc"]))
        return ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        return ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> Response:
        return ApiError(503, str(e), code="engine_dead").response()

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        return ApiError(500, f"Internal server error: {type(e).__name__}").response()


def build_app(args: argparse.Namespace, config: EngineConfig) -> FastAPI:
    names = args.served_model_name or [args.model or EMBEDDED_NAME]
    state = ServerState(
        args=args,
        served_model_names=names,
        metrics=ServerMetrics(names[0], lambda: state.engine.get_stats() if state.engine else None),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = AsyncLLM.from_config(config)
            except BaseException as e:  # noqa: BLE001 - reported, and the server exits
                logger.exception("Could not load the model")
                state.load_error = e
                loop.call_soon_threadsafe(state.on_load_failure)
                return
            loop.call_soon_threadsafe(state.attach, engine)

        logger.info("Loading model %s", args.model or f"{EMBEDDED_NAME} (embedded)")
        # A daemon thread, not the default executor: a server told to stop while loading need not wait.
        state.loader = threading.Thread(target=load, name="heron-load", daemon=True)
        state.loader.start()
        stats = asyncio.create_task(_log_stats(state))
        try:
            yield
        finally:
            stats.cancel()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(
        title="Heron",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        description="OpenAI-compatible API of the Heron inference engine.",
    )
    app.state.server = state
    app.include_router(router)
    app.mount("/swagger-ui", StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")
    _install_error_handlers(app)
    keys = api_keys(args)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    return app


async def _log_stats(state: ServerState) -> None:
    stat_logger = StatLogger()
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        if state.engine is not None:
            stat_logger.log(state.engine.get_stats())


class _Server(uvicorn.Server):
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


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config = serve_engine_config(args)
    try:
        config.verify()
    except ValueError as e:
        logger.error("%s", e)
        return 2
    app = build_app(args, config)
    # The event loop holds the GIL most of the time under load; the thread that reads the engine's outputs
    # must not wait the default 5 ms for it at each step, or the engine's pipe fills and the engine waits.
    sys.setswitchinterval(0.001)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    state: ServerState = app.state.server
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    code = 1 if state.load_error is not None or not server.started else 0
    if state.loader is not None and state.loader.is_alive():
        # Stopped while loading: the loader is inside torch and cannot be interrupted, and finalizing the
        # interpreter under it aborts the process. Nothing is left to clean up, so leave at once.
        logging.shutdown()
        os._exit(code)
    return code
