"""A request that asks to switch protocols (`Upgrade: h2c`, `Upgrade: websocket`, ...) is served as the HTTP/1.1
request it also is, as RFC 9110 (7.8) lets a server do that switches to nothing.

httptools (llhttp) takes such a request's headers as the last HTTP it will see on the connection: it ends the
message there, body unread, and stops. uvicorn then logged "Unsupported upgrade request." and ran the app with an
empty body, and the connection served nothing more: `curl --http2 http://...` POSTing a completion got 400 "The
request body is empty". So the connection (apiserver/http_connection.py) holds the request back when its headers
ask for an upgrade, and once the parser stops, parses it again with a new parser from this head, which asks for
none, followed by the bytes the old parser left (the body, and any request after it).
"""
from __future__ import annotations

import httptools


def head_without_upgrade(method: bytes, url: bytes, http_version: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request's head again, without its `Upgrade` header and the `upgrade` token of its `Connection`."""
    lines = [b"%s %s HTTP/%s\r\n" % (method, url, http_version.encode())]
    for name, value in headers:
        if name.lower() == b"upgrade":
            continue
        if name.lower() == b"connection":
            value = b", ".join(t.strip() for t in value.split(b",") if t.strip().lower() not in (b"upgrade", b""))
            if not value:
                continue
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"\r\n")
    return b"".join(lines)


def new_parser(protocol) -> httptools.HttpRequestParser:
    """A parser as uvicorn's HttpToolsProtocol makes one."""
    parser = httptools.HttpRequestParser(protocol)
    try:
        parser.set_dangerous_leniencies(lenient_data_after_close=True)  # (uvicorn's: it answers pipelined requests)
    except AttributeError:  # httptools < 0.6.3
        pass
    return parser
