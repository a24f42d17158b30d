"""Errors as gRPC statuses: one exception that carries its status code, and the one table that maps the API
server's own errors (apiserver/errors.py) onto codes, so both front ends refuse the same things the same way."""
from __future__ import annotations

import grpc

from apiserver.engine_client import EngineDeadError
from apiserver.errors import ApiError, EngineDead, InvalidRequest, Overloaded, Unauthorized

Code = grpc.StatusCode


class RpcError(Exception):
    """Ends the call with `code` and `message` (the client's `details()`)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RpcError:
    return RpcError(Code.INVALID_ARGUMENT, message)


# The API server's errors, by the gRPC code that says the same thing.
_CODE_OF_ERROR = {
    InvalidRequest: Code.INVALID_ARGUMENT,
    # "A limit is full, retry later": the standard code for it, which gateways retry elsewhere.
    Overloaded: Code.RESOURCE_EXHAUSTED,
    EngineDead: Code.UNAVAILABLE,
    Unauthorized: Code.UNAUTHENTICATED,
}


def as_rpc_error(exc: BaseException) -> RpcError | None:
    """The status a client gets for `exc`; None for anything unexpected (a bug: INTERNAL, logged)."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, EngineDeadError):
        return RpcError(Code.UNAVAILABLE, f"The engine is not available: {exc}")
    if isinstance(exc, ApiError):
        code = _CODE_OF_ERROR.get(type(exc), Code.INVALID_ARGUMENT if exc.status < 500 else Code.UNAVAILABLE)
        return RpcError(code, exc.message)
    return None
