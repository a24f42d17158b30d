"""A close while the client is still sending its request's body, done as nginx's lingering close.

The server answers a request before its body is in when it refuses the body (413 over --max-request-body-bytes,
declared or counted) or the group stops (503), and closes the connection after the answer; so too a request whose
URL or headers are still coming past --max-request-header-bytes (431, apiserver/http_connection.py). Closing a socket with
unread bytes in its receive buffer, or receiving more after the close, makes Linux send RST instead of FIN, and
a client still writing its body then loses the answer that was waiting, unread, in its own receive buffer (its
next read fails with ECONNRESET). So such a connection first sends the answer and its FIN (the write side shut
down), then reads and drops what the client still sends, and closes once the client has closed its side, has
sent nothing for LINGER_IDLE_SECONDS (it reads our answer, or is gone), or after LINGER_SECONDS in all (a body
that is still coming then is cut: a bound on what a client can make the server read for nothing).

Only while a request's body is still being read does the connection's cycle write through a `LingeringClose`,
whose close is the lingering one; every other write goes straight to the transport.
"""
from __future__ import annotations

from collections.abc import Callable

LINGER_SECONDS = 5.0
LINGER_IDLE_SECONDS = 1.0


class LingeringClose:
    """The transport of a request whose body is still being read: writes pass through, close lingers."""

    __slots__ = ("_connection",)

    def __init__(self, connection):
        self._connection = connection  # an apiserver.http_connection.HttpConnection

    def write(self, data: bytes) -> None:
        self._connection.transport.write(data)

    def close(self) -> None:
        self._connection.linger()

    def __getattr__(self, name: str):
        return getattr(self._connection.transport, name)


class DiscardingParser:
    """Stands in for the connection's HTTP parser while it lingers: what arrives is read and dropped."""

    __slots__ = ("_on_read",)

    def __init__(self, on_read: Callable[[], None]):
        self._on_read = on_read

    def feed_data(self, data: bytes) -> None:
        self._on_read()
