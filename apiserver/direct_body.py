"""A streamed response's body written straight to its connection (--direct-stream-events).

An SSE event sent through ASGI passes the app's whole send chain (Starlette's error and exception
middleware, each a coroutine of its own, then uvicorn's `send`) before uvicorn frames it as an HTTP chunk and
writes it. None of those layers looks at a body, and a streamed token's event is mostly such layers' work:
this writes the chunk itself, framed as uvicorn frames it, into the same transport (the loop's write batch
when there is one), so the order of the connection's bytes holds. The head of the response and its last
chunk (which ends the body) still go through `send`, which keeps uvicorn's bookkeeping of the response.

It is offered to a request (in its ASGI scope, under DIRECT_BODY) only where no user middleware (--middleware)
could change a body on its way, and it declines (`writable()` False) whenever `send` has more to do than
frame and write: before the head or after the end, once the client is gone, a body not chunked, and while the
client reads slower than we write (the transport paused: `send` waits that out).
"""
from __future__ import annotations

DIRECT_BODY = "supervise.direct_body"  # the scope key


class DirectBody:
    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle, flow):
        """`cycle`: uvicorn's RequestResponseCycle of the request; `flow`: its connection's flow control."""
        self._cycle = cycle
        self._flow = flow
        self._transport = cycle.transport

    def writable(self) -> bool:
        cycle = self._cycle
        return (cycle.response_started and not cycle.response_complete and not cycle.disconnected
                and cycle.chunked_encoding is True and not self._flow.write_paused)

    def write(self, body: bytes) -> None:
        """One chunk of the body (never empty: an empty chunk would end it). Only after `writable()`."""
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))
