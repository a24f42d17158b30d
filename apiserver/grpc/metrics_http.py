"""Prometheus metrics over plain HTTP on --metrics-port, since a gRPC server has no `GET /metrics` route.

Every gRPC API server listens on the port (SO_REUSEPORT, like the gRPC port itself) and any of them answers a
scrape with the whole group's totals (apiserver/metrics.py sums every server's file). A scrape is one short
request per connection, so this is the least HTTP that serves it: `GET /metrics`, `Connection: close`.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Callable

READ_TIMEOUT = 10.0
MAX_HEAD = 16 * 1024
_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def _response(status: bytes, body: bytes, content_type: bytes = b"text/plain; charset=utf-8") -> bytes:
    return b"".join((b"HTTP/1.1 ", status, b"\r\nContent-Type: ", content_type, b"\r\nContent-Length: ",
                     str(len(body)).encode(), b"\r\nConnection: close\r\n\r\n", body))


async def serve_metrics(host: str, port: int, render: Callable[[], str]) -> asyncio.AbstractServer:
    """Starts answering scrapes on host:port; close the returned server to stop."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            method, target = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
            if target.split(b"?", 1)[0] != b"/metrics":
                writer.write(_response(b"404 Not Found", b"only /metrics is served here\n"))
            elif method not in (b"GET", b"HEAD"):
                writer.write(_response(b"405 Method Not Allowed", b"GET /metrics\n"))
            else:
                body = render().encode()
                writer.write(_response(b"200 OK", body if method == b"GET" else b"", _CONTENT_TYPE))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that sends no proper request head gets nothing but the close
        finally:
            writer.close()

    return await asyncio.start_server(answer, sock=sock, limit=MAX_HEAD)
