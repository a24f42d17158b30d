"""Errors as gRPC statuses: one exception that carries its status code, and the HTTP API's one error table
(apiserver/errors.py) read in gRPC codes, so both front ends refuse the same things with the same words."""
from __future__ import annotations

import grpc

from apiserver.engine_errors import StreamBacklogFull
from apiserver.errors import Overloaded, as_api_error, is_expected

Code = grpc.StatusCode

# The HTTP status the error table gives, as the gRPC code that says the same thing.
_CODE_OF_STATUS = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    404: Code.NOT_FOUND,
    413: Code.INVALID_ARGUMENT,
    500: Code.INTERNAL,  # the engine failed the request (its reason is the message)
    503: Code.UNAVAILABLE,  # the engine is gone
}


class RpcError(Exception):
    """Ends the call with `code` and `message` (the client's `details()`)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RpcError:
    return RpcError(Code.INVALID_ARGUMENT, message)


def as_rpc_error(exc: BaseException) -> RpcError | None:
    """The status a client gets for `exc`; None for anything unexpected (a bug: INTERNAL, logged)."""
    if isinstance(exc, RpcError):
        return exc
    if not is_expected(exc):
        return None
    error = as_api_error(exc)
    if isinstance(exc, (Overloaded, StreamBacklogFull)):
        # "A limit is full" has a code of its own (gateways retry an admission's elsewhere).
        return RpcError(Code.RESOURCE_EXHAUSTED, error.message)
    code = _CODE_OF_STATUS.get(error.status, Code.INVALID_ARGUMENT if error.status < 500 else Code.UNAVAILABLE)
    return RpcError(code, error.message)
