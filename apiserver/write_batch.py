"""Socket writes of one event-loop pass, made together after the pass's Python work (--write-batching).

When an engine step arrives, the loop wakes every stream it touched, one after another: each decodes its
tokens, formats its SSE event and writes it. A `write()` to a TCP socket runs the kernel's TCP path (on
loopback the receiver's as well). Made between two streams' Python work, the writes cost about twice what
they cost made back to back (a toy uvloop loop on the 2-core AMD EPYC VM; most likely each finds the kernel's
code and data evicted from the CPU's caches by the Python before it, and evicts the Python's in turn). Queued
and made back to back in one callback after the pass, they cost a paced stream's event 8-25% less of the API
server's CPU, side by side (README: "Streamed tokens: socket writes batched").

The delay is the rest of the pass (the callback is queued behind the handles ready now), never a timer: a
lone write goes out as soon as its handler returns, and a pass with many connections flushes every
MAX_CONNECTIONS of them. Order holds: one connection's writes keep their order and go out in one `write()`
(a response's head and body together), and whatever ends a connection (close, abort, EOF) first writes
what is pending for it. The client's EOF matters most: uvloop closes the transport itself when the protocol's
`eof_received` returns (as uvicorn's does), past this wrapper, and a close with nothing in the transport's
own buffer drops every later write. A client that half-closes after its request (`nc -N`, Go's CloseWrite)
has its answer in the batch by then (the read that brings the EOF comes a pass after the request's), so the
connection's `eof_received` hands it to the transport first (apiserver/http_connection.py).
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# Connections with writes queued before the batch goes out anyway: bounds how long the first of them waits
# behind the others' Python work (at ~20 us of it per streamed event, a few milliseconds).
MAX_CONNECTIONS = 128


class WriteBatch:
    """The pending writes of this pass of the loop, made in one callback queued at the first of them."""

    __slots__ = ("_loop", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        # Per transport, its chunks in order (a dict keeps the order in which connections first wrote).
        self._pending: dict[asyncio.Transport, list[bytes]] = {}

    def write(self, transport: asyncio.Transport, data: bytes) -> None:
        pending = self._pending
        chunks = pending.get(transport)
        if chunks is not None:
            chunks.append(data)
            return
        if not pending:
            self._loop.call_soon(self.flush)
        elif len(pending) >= MAX_CONNECTIONS:
            self.flush()  # the callback already queued finds what comes after this
        self._pending[transport] = [data]  # self's: a flush above put a new dict there

    def flush_one(self, transport: asyncio.Transport) -> None:
        """`transport`'s pending writes, now (it is about to close); the others still wait for the pass."""
        chunks = self._pending.pop(transport, None)
        if chunks is not None and not transport.is_closing():
            transport.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for transport, chunks in pending.items():
            if transport.is_closing():
                continue  # the client went away meanwhile: its protocol already knows
            try:
                transport.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            except Exception:  # one broken transport must not cost the others their writes
                log.exception("a batched write failed")


class BatchedTransport:
    """A connection's transport whose writes join the loop's batch; all else is the transport's own."""

    __slots__ = ("_transport", "_batch")

    def __init__(self, transport: asyncio.Transport, batch: WriteBatch):
        self._transport = transport
        self._batch = batch

    def write(self, data: bytes) -> None:
        if data:
            self._batch.write(self._transport, data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def flush(self) -> None:
        """What this connection has pending, now: before anything closes its transport."""
        self._batch.flush_one(self._transport)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self.flush()
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
