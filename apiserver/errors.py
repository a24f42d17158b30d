"""Every error the API answers with, and the one table that maps exceptions to HTTP statuses.

Each error goes out in the OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, so that
OpenAI clients raise their usual exception types. Anything unexpected is a 500 with a generic message: the
traceback goes to the log, never to the client.
"""
from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the client should see, as it is. Subclasses pick the status and the OpenAI error type."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


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


class RouteNotFound(ApiError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"


class Overloaded(ApiError):
    """Admission limits are full: a load balancer should retry elsewhere or later."""

    status = 503
    type = "overloaded_error"


class EngineDead(ApiError):
    """The engine core is gone; this server cannot answer anything that needs the model any more."""

    status = 503
    type = "service_unavailable_error"


class InternalError(ApiError):
    status = 500
    type = "internal_server_error"


class RequestTimeout(ApiError):
    """The request's headers or body did not arrive in time (--timeout-request-header)."""

    status = 408


class ShuttingDown(ApiError):
    """The group is stopping: a request that arrives on an open connection is not started."""

    status = 503
    type = "service_unavailable_error"


def error_body(exc: ApiError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_response(exc: ApiError, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(error_body(exc)), exc.status, headers, media_type="application/json")


def as_api_error(exc: BaseException) -> ApiError:
    """The one exception-to-status table: what the client is told about `exc`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, HTTPException):
        # Starlette's own routing errors (unknown route, wrong method, bad Content-Length...).
        if exc.status_code == 404:
            return RouteNotFound(f"{exc.detail}", code="route_not_found")
        if exc.status_code == 405:
            return MethodNotAllowed(f"{exc.detail}")
        if exc.status_code < 500:
            error = InvalidRequest(f"{exc.detail}")
            error.status = exc.status_code
            return error
    log.error("unexpected error while serving a request", exc_info=exc)
    return InternalError("Internal server error: the server could not complete the request; see its log.")


async def starlette_exception_handler(request, exc: Exception) -> Response:
    """Installed for HTTPException and Exception, so routing errors and crashes also get the OpenAI body."""
    error = as_api_error(exc)
    return error_response(error, getattr(exc, "headers", None))
