"""What the engine client raises to the code that serves a request: an engine that is down, a rank not served, a
request the engine failed, a request this server stopped, a stream whose client reads too slowly. The error table
(apiserver/errors.py) and the gRPC status map (apiserver/grpc/status.py) turn them into answers."""
from __future__ import annotations

from ipc import grammar as grammars


class EngineDeadError(Exception):
    """The engine core serving a request is gone (or every one is)."""


class UnknownRank(ValueError):
    """A request pinned to a data-parallel rank this group does not serve."""


class EngineRequestError(Exception):
    """The engine failed one of a request's sequences (FinishReason.ERROR); the message is its reason, whole
    (the log gets it; the client a first line: apiserver/errors.py). Here with the engine's other errors, so
    that the error table needs no detokenizer."""

    def __init__(self, reason: str, request_id: str | None = None, param: str | None = None):
        super().__init__(reason)
        self.request_id = request_id
        self.param = param


class GrammarFailed(EngineRequestError):
    """The request's grammar failed in the engine (ipc.grammar.engine_error): the request's fault, a 400 whose
    `param` is the field the grammar came from."""


def request_error(out, param: str | None = None) -> EngineRequestError:
    """The exception for an engine output that failed its request (FinishReason.ERROR); `param`: the request's
    field that gave its grammar."""
    reason = out.error or "no reason given"
    kind = GrammarFailed if grammars.is_engine_error(out.error) else EngineRequestError
    return kind(reason, out.request_id, param)


class RequestAborted(Exception):
    """This server stopped the request (client disconnect, a stop string, shutdown)."""


class StreamBacklogFull(Exception):
    """The request's outputs waiting for its consumer passed --max-stream-backlog-mb, or held most when all streams'
    passed --max-total-stream-backlog-mb: its client reads slower than the engine writes, or not at all. The
    request is aborted; the message says which limit."""
