"""Balanced accepts on the group's shared listening socket, for the connections of apiserver/http_connection.py.

Every API server watches the same listening socket. The kernel wakes them all; whoever calls accept()
first gets the connection. Left alone, the server whose loop happens to be idlest at that instant wins,
which piles long-lived keep-alive connections onto a few servers. So before it accepts, a server that holds
more open connections than the least busy live server waits a little (--accept-backoff-ms, default 5 ms):
a less busy server takes the connection meanwhile, or, once the wait is over, this one does. The counts
live in the group's shared memory, one slot per server, each written only by its owner.

Out of file descriptors (EMFILE, ENFILE) or kernel memory, the listening socket stays readable and every
accept() fails at once: the loop would spin and log without end. So a failed accept pauses accepting for
ACCEPT_PAUSE_SECONDS, as asyncio's own accept loop (under uvicorn) pauses 1 s and nginx retries after its
accept_mutex_delay of 500 ms, and the failures are logged at most once a second, with their count.

With TLS (--ssl-certfile) the event loop's TLS layer wraps each connection, its handshake bounded by
--timeout-request-header (a client that connects and never finishes it holds nothing longer than one that never
sends its headers); a handshake that fails (plain HTTP to the TLS port, an untrusted client certificate, a
timeout) closes the connection before it reaches HTTP, without a log line (anyone can make one). How an idle TLS
connection is closed: apiserver/http_connection.py.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time

from ipc.shared_state import GroupState

log = logging.getLogger(__name__)

ACCEPTS_PER_WAKEUP = 16  # a burst of connections is taken in one go, then the balance is looked at again
ACCEPT_PAUSE_SECONDS = 0.5  # after a failed accept: the error (EMFILE...) would repeat at once
FAILURE_REPORT_SECONDS = 1.0  # failed accepts are logged at most this often, with their count


class BalancedAcceptor:
    """Stands where uvicorn keeps its asyncio Server: close() stops accepting, wait_closed() returns at once."""

    def __init__(self, listen_socket: socket.socket, protocol_factory, state: GroupState, slot: int,
                 backoff_seconds: float, tls: ssl.SSLContext | None = None, handshake_timeout: float = 30.0):
        self._sock = listen_socket
        self._tls = tls
        # (connect_accepted_socket refuses a handshake timeout without TLS)
        self._handshake_timeout = handshake_timeout if tls is not None else None
        self._sock.setblocking(False)
        self._factory = protocol_factory
        self._state = state
        self._slot = slot
        self._backoff = backoff_seconds
        self._loop = asyncio.get_running_loop()
        self._open = 0
        self._deferred_since: float | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self._failed_accepts = 0  # since the last report
        self._failures_reported_at = 0.0
        self._last_failure: float | None = None  # None: accepts work
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    @property
    def open_connections(self) -> int:
        return self._open

    def _on_readable(self) -> None:
        if self._should_defer():
            self._pause(self._backoff - (time.monotonic() - self._deferred_since))
            return
        self._deferred_since = None
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # another server took it
            except ConnectionAbortedError:
                continue  # the client gave up while it waited in the backlog
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: keep serving what we have
                self._accept_failed(exc)
                return
            if self._last_failure is not None:
                self._accepting_again()
            self._adopt(conn)
            if self._should_defer():
                return

    def _pause(self, seconds: float) -> None:
        """Stop listening for a moment, or the loop would spin on the still-readable socket."""
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(max(seconds, 0.0005), self._resume)

    def _accept_failed(self, exc: OSError) -> None:
        self._failed_accepts += 1
        now = self._last_failure = time.monotonic()
        if now - self._failures_reported_at >= FAILURE_REPORT_SECONDS:
            what = "out of file descriptors" if exc.errno in (errno.EMFILE, errno.ENFILE) else "accept failed"
            log.warning("%s (%s): %d failed accept(s) since the last report; trying again every %.1f s",
                        what, exc, self._failed_accepts, ACCEPT_PAUSE_SECONDS)
            self._failed_accepts = 0
            self._failures_reported_at = now
        self._pause(ACCEPT_PAUSE_SECONDS)

    def _accepting_again(self) -> None:
        """Said once accepts have worked for a report interval, so that churn at the limit (one descriptor
        freed, taken, the next accept failing) is not a line per connection."""
        if time.monotonic() - self._last_failure < FAILURE_REPORT_SECONDS:
            return
        log.warning("accepting connections again (%d failed accept(s) since the last report)", self._failed_accepts)
        self._failed_accepts = 0
        self._last_failure = None

    def _should_defer(self) -> bool:
        if self._backoff <= 0 or self._open <= self._state.least_open_connections():
            return False
        now = time.monotonic()
        if self._deferred_since is None:
            self._deferred_since = now
        return now - self._deferred_since < self._backoff

    def _resume(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _adopt(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE events must not wait for Nagle
        self._count(+1)
        protocol = self._factory()
        lost = protocol.connection_lost

        def connection_lost(exc, _lost=lost):
            self._count(-1)
            _lost(exc)

        protocol.connection_lost = connection_lost  # the count must fall however the connection ends
        self._loop.create_task(self._connect(conn, protocol))

    async def _connect(self, conn: socket.socket, protocol) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: protocol, sock=conn, ssl=self._tls,
                                                     ssl_handshake_timeout=self._handshake_timeout)
        except OSError:  # ssl.SSLError and TimeoutError among them; the protocol never saw the connection
            self._count(-1)
            conn.close()

    def _count(self, delta: int) -> None:
        self._open += delta
        self._state.set_open_connections(self._slot, self._open)

    def close(self) -> None:
        """Stop accepting, and close this process's copy of the listening socket: while any process holds
        it, the kernel completes handshakes into the backlog for connections nobody here will take. Others
        serving the port (a rolling restart's new servers) hold their own copies."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    async def wait_closed(self) -> None:
        return None
