"""Closing a connection that has nothing in flight (its keep-alive timeout, or a stop): at once, also over TLS.

A TLS transport's close() sends close_notify and then waits for the client's, up to the event loop's
ssl_shutdown_timeout (30 s), before the connection goes. An HTTP client's pool never answers on an idle
connection, so every idle TLS connection we closed stayed open, and counted, 30 s longer, and a stop or a rolling
restart took 30 s wherever TLS clients kept pools (the mutual-TLS test's stop: 31 s). That wait cannot be
shortened alone: the same timer also bounds the flush of what is still unsent, and 5 s cut a slow reader's 4 MB
answer short (a sweep read one at 200 KB/s).

So a connection closed while idle is aborted when the kernel says the client has acknowledged every byte sent
(SIOCOUTQ 0) and the TLS layer holds nothing more: nothing can be lost, and only the close_notify courtesy is
skipped (HTTP/1.1 knows where its messages end; clients treat such an end as a closed keep-alive connection).
Otherwise, and for every plain-TCP connection, it is the usual close, which sends what is left first.
"""
from __future__ import annotations

import asyncio
import fcntl
import struct
import termios


def close_idle(transport: asyncio.Transport, tls: bool) -> None:
    if transport.is_closing():
        return
    if tls and _all_acknowledged(transport):
        transport.abort()
    else:
        transport.close()


def _all_acknowledged(transport) -> bool:
    if transport.get_write_buffer_size():
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        unacknowledged = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return False
    return unacknowledged == 0
