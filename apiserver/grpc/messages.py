"""Request messages as the handlers get them: grpcio hands each one's bytes to a deserializer of ours, which never
raises (grpcio would answer UNKNOWN for what is the client's mistake) and counts large ones.

A parsed message weighs several times its bytes (3.9 million prompt ids, 7.8 MB on the wire, some 35 MB parsed),
and grpcio parses every call's message as it arrives, before its handler runs: 64 such calls at once held an API
server at 2.3 GB before each was refused for its length. So a message of LARGE_BODY_BYTES or more takes its bytes
from the API server's --max-large-request-bodies-mb, as an HTTP body does, until the call ends; one that would pass
it is not parsed at all, and its call ends RESOURCE_EXHAUSTED (retry later)."""
from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import DecodeError

from apiserver.grpc.status import Code, RpcError, invalid_argument
from apiserver.large_body_budget import LargeBodyBudget
from apiserver.validation import LARGE_BODY_BYTES


class Refused:
    """Stands for a message the deserializer did not hand on: the status its call ends with."""

    __slots__ = ("error",)

    def __init__(self, error: RpcError):
        self.error = error


class LargeMessage:
    """A large message, its bytes held in the budget for as long as this wraps it: the call keeps it to its end.
    Released when it is freed, not by the call, so a call cancelled before its handler ran holds nothing."""

    __slots__ = ("message", "_budget", "_size")

    def __init__(self, message, budget: LargeBodyBudget, size: int):
        self.message = message
        self._budget = budget
        self._size = size
        budget.take(size)

    def __del__(self):
        self._budget.give(self._size)


def request_reader(parse: Callable, budget: LargeBodyBudget) -> Callable:
    """A request deserializer for grpcio: `parse(data)`'s message, a LargeMessage, or a Refused."""

    def deserialize(data: bytes):
        size = len(data)
        large = size >= LARGE_BODY_BYTES and budget.limit
        if large and (refusal := budget.refusal(size)):
            return Refused(RpcError(Code.RESOURCE_EXHAUSTED, refusal))
        try:
            message = parse(data)
        except (DecodeError, ValueError) as exc:
            return Refused(invalid_argument(f"malformed request message: {exc}"))
        return LargeMessage(message, budget, size) if large else message

    return deserialize


def unwrapped(request):
    """The message a handler reads (raises the refusal's RpcError)."""
    if isinstance(request, LargeMessage):
        return request.message
    if isinstance(request, Refused):
        raise request.error
    return request
