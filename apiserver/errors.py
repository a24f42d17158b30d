"""Every error the API answers with, and the one table that maps exceptions to HTTP statuses.

Each error goes out in the OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, so that
OpenAI clients raise their usual exception types. The app registers `exception_handlers()` once: the
exceptions of the table become their answer; anything else is a 500 with a generic message, and its
traceback goes to the log (uvicorn's "Exception in ASGI application"), never to the client.
"""
from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from apiserver.engine_errors import EngineDeadError, EngineRequestError, GrammarFailed, StreamBacklogFull, UnknownRank
from apiserver.grammar_checker import CheckerUnavailable
from ipc import grammar
from ipc.messages import error_summary

log = logging.getLogger(__name__)

# nginx's status for a client that closed the connection before it was answered: nobody reads the answer,
# but /metrics counts it as the client's doing (4xx), not the server's.
CLIENT_CLOSED_REQUEST = 499
# Seconds a client should wait after an admission 503: a whole second (the header takes integers) is the
# shortest wait that still backs off, and requests in flight free their places within seconds. The openai
# client honours it instead of its own back-off.
RETRY_AFTER_SECONDS = "1"
# The id a request goes by, in its scope: the X-Request-Id header's (the request-id middleware reads it), else the one
# the generation endpoints settle (GenerationServing.request_id); a 5xx is logged under it.
REQUEST_ID_SCOPE_KEY = "supervise.request_id"


class ApiError(Exception):
    """An error the client should see, as it is. Subclasses pick the status and the OpenAI error type; the
    table below makes plain instances for other exceptions."""

    status = 400
    type = "invalid_request_error"
    headers: dict[str, str] | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None, *,
                 status: int | None = None, type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if headers is not None:
            self.headers = headers


class InvalidRequest(ApiError):
    """Malformed JSON, a missing or mistyped field, an unsupported option, a prompt too long for the model."""


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class ModelNotFound(ApiError):
    status = 404
    type = "NotFoundError"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class RequestTooLarge(ApiError):
    """A body over --max-request-body-bytes. The connection closes after it (uvicorn honours the header), as
    servers close after refusing a body: the rest of it, still on its way, is read and dropped for a while
    first (apiserver/lingering_close.py)."""

    status = 413
    headers = {"Connection": "close"}


class Overloaded(ApiError):
    """Admission limits are full: a load balancer should retry elsewhere or later."""

    status = 503
    type = "overloaded_error"
    headers = {"Retry-After": RETRY_AFTER_SECONDS}


class LargeBodiesFull(Overloaded):
    """Large bodies' bytes read by requests in flight fill --max-large-request-bodies-mb: refused before (the rest of)
    its body is read, and the connection closes after the answer, as after a 413 (apiserver/lingering_close.py)."""

    headers = {"Retry-After": RETRY_AFTER_SECONDS, "Connection": "close"}


def _http_error(exc: HTTPException) -> ApiError:
    # Starlette's own routing errors (unknown route, wrong method with its Allow header, ...).
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    code = "route_not_found" if exc.status_code == 404 else None
    return ApiError(f"{exc.detail}", code=code, status=exc.status_code, type=kind, headers=exc.headers)


# The one exception-to-answer table. Its keys are also the exceptions the app registers handlers for.
_TABLE = {
    ApiError: lambda exc: exc,
    HTTPException: _http_error,
    EngineDeadError: lambda exc: ApiError(
        f"The engine is not available: {exc}", status=503, type="service_unavailable_error"),
    UnknownRank: lambda exc: ApiError(
        f"{exc}.", param="x-data-parallel-rank", code="unknown_data_parallel_rank"),
    # A library's reason may run to pages (llguidance's parser state, the whole grammar): the client gets its first
    # line, the log the whole (log_server_error).
    GrammarFailed: lambda exc: InvalidRequest(
        f"Invalid `{exc.param or 'structured_outputs'}`: {grammar.short_reason(str(exc))}", param=exc.param,
        code="invalid_structured_output"),
    # The system would not start the grammar checker (out of file descriptors, say): for now, not for good.
    CheckerUnavailable: lambda exc: ApiError(
        f"Structured outputs are not available on this server right now: {exc}; try again.", status=503,
        type="service_unavailable_error", headers={"Retry-After": RETRY_AFTER_SECONDS}),
    EngineRequestError: lambda exc: ApiError(
        f"The engine failed this request: {error_summary(str(exc))}", status=500, type="internal_server_error"),
    # The client's doing (it does not read), told in the stream's error event: a 4xx, not logged as a failure.
    StreamBacklogFull: lambda exc: ApiError(str(exc), status=408, type="client_too_slow", code="stream_backlog_full"),
    ClientDisconnect: lambda exc: ApiError(
        "The client closed the connection before its request was read.", status=CLIENT_CLOSED_REQUEST,
        type="client_closed_request"),
}
_INTERNAL = "Internal server error: the server could not complete the request; see its log."


def is_expected(exc: BaseException) -> bool:
    """Whether `exc` is in the table (else it is a bug, whose traceback belongs in the log)."""
    return any(cls in _TABLE for cls in type(exc).__mro__)


def as_api_error(exc: BaseException) -> ApiError:
    """What the client is told about `exc`."""
    for cls in type(exc).__mro__:
        convert = _TABLE.get(cls)
        if convert is not None:
            return convert(exc)
    return ApiError(_INTERNAL, status=500, type="internal_server_error")


class RequestTimeout(ApiError):
    """The request's headers or body did not arrive in time (--timeout-request-header)."""

    status = 408


class ShuttingDown(ApiError):
    """The group is stopping: a request that arrives on an open connection is not started."""

    status = 503
    type = "service_unavailable_error"


def error_body(exc: ApiError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: ApiError) -> Response:
    return Response(orjson.dumps(error_body(exc)), exc.status, exc.headers, media_type="application/json")


def log_server_error(error: ApiError, exc: BaseException, request_id: str | None, where: str) -> None:
    """One WARNING line for a 5xx the server answers, with the request's id and the whole reason (its line breaks
    as \\n), so that an operator who sees 5xx in /metrics finds why. Not for an admission 503 (Overloaded): that
    is the designed answer to load, counted in /metrics, and a line for each would turn a burst into a flood."""
    if error.status >= 500 and not isinstance(error, Overloaded):
        reason = str(exc) if isinstance(exc, EngineRequestError) else error.message
        log.warning("%s %s: %d %s: %s", where, request_id or "(no request id)", error.status, error.type,
                    reason.strip().replace("\n", "\\n"))


def answer_id(request, exc: BaseException) -> str | None:
    """The request id to log an answer under: the engine's for a request it ran, else the client's header."""
    return getattr(exc, "request_id", None) or request.scope.get(REQUEST_ID_SCOPE_KEY) or request.headers.get("x-request-id")


async def _answer(request, exc: Exception) -> Response:
    error = as_api_error(exc)
    log_server_error(error, exc, answer_id(request, exc), f"{request.method} {request.url.path}")
    return error_response(error)


def exception_handlers() -> dict:
    """For Starlette: the table's exceptions, and Exception (its 500 is answered by Starlette's outermost
    ServerErrorMiddleware, which then re-raises so that uvicorn logs the traceback)."""
    return {**dict.fromkeys(_TABLE, _answer), Exception: _answer}
