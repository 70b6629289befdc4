"""The API's errors: OpenAI's error body, what each failure of a request is answered with, and the log of
unexpected ones."""

from __future__ import annotations

import json
import logging

from fastapi.responses import Response

from heron.engine.async_llm import EngineDeadError, RequestAbortedError
from heron.engine.data_parallel import ReplicaDeadError
from heron.entrypoints.openai.admission import RETRY_AFTER_S, Overloaded
from heron.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingRequest

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingRequest.model_fields)


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> str:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        # ASCII JSON: text quoted from a request (a stray surrogate, say) can always be sent.
        return json.dumps(ErrorResponse(error=info).model_dump())

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, headers=self.headers, media_type="application/json")

    def event(self) -> str:
        """The error as a server-sent event, for a stream whose status line is long gone."""
        return sse(self.body())


def api_error(e: BaseException, prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> ApiError:
    """The API's answer to what a request raised: the engine's rejection (its message starts with the field
    at fault), the engine's death, the server's shutdown or overload; anything else is a 500."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValueError):
        field = str(e).split(" ", 1)[0]
        param = max_tokens_param if field == "max_tokens" else field if field in _SAMPLING_FIELDS else prompt_param
        return ApiError(400, str(e), param=param)
    if isinstance(e, ReplicaDeadError):
        return ApiError(503, f"{e}: retry the request.", code="replica_dead")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"{e}; the server is exiting so that its supervisor restarts it.", code="engine_dead")
    if isinstance(e, RequestAbortedError):
        return ApiError(503, str(e), code="server_shutting_down")
    if isinstance(e, Overloaded):
        return ApiError(503, str(e), code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    log_internal_error(e)
    return ApiError(500, f"Internal server error: {type(e).__name__}", code="internal_error")


_seen_errors: set[tuple] = set()


def log_internal_error(e: BaseException) -> None:
    """One line per failed request; the traceback only the first time a given place fails."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (type(e), tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else (type(e),)
    if where in _seen_errors or len(_seen_errors) >= 1000:
        logger.error("Internal server error: %r", e)
    else:
        _seen_errors.add(where)
        logger.error("Internal server error: %r (traceback shown once per place)", e, exc_info=e)
