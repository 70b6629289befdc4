"""ASGI middleware around the routes, outermost first: unexpected errors, API keys, the body's size."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron.entrypoints.openai.errors import ApiError, log_internal_error

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class InternalErrorMiddleware:
    """An exception no handler took becomes a 500 in the API's error format, logged in one line (the
    traceback once per place), and the connection stays open for the client's next request. (Starlette's
    own last resort re-raises, and uvicorn then logs a traceback and closes the connection.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            pass  # nobody is left to answer, and nothing went wrong here
        except Exception as e:  # noqa: BLE001 - this is the last place that can answer
            log_internal_error(e)
            if not started:
                error = ApiError(500, f"Internal server error: {type(e).__name__}", code="internal_error")
                await error.response()(scope, receive, send)
            # else: a response is half sent and cannot turn into an error; uvicorn closes the connection.


class ApiKeyMiddleware:
    """Bearer-key check on the model's routes (/health, /metrics and the docs stay open). Every key is
    compared in constant time, so neither a key's prefix nor which key matched leaks through timing."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
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


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes (--max-request-body-bytes): at once when Content-Length
    says so, else as soon as the bytes received pass it, so that no more of it is read or kept."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"The request body is larger than this server accepts ({self.limit} bytes, --max-request-body-bytes)."
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await ApiError(413, message, code="request_too_large").response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.limit:
                    # Raised inside the route's reading of the body; FastAPI passes HTTPExceptions on to the
                    # app's handler, which answers in the API's format.
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, counted, send)
