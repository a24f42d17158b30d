"""--access-log: one line per HTTP request once its answer is done, as uvicorn's access log gives it (which
vLLM's server prints by default), with how long the answer took: a stream's line comes at its end.

    127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 1.532 s

Off by default: a line costs each request the API server's CPU to write it (README, Operating the group).
The path is logged as the client sent it, percent-escapes and all: decoded, a `%0a` would let any client write a
line of its own into the log. A request whose client left before its answer shows 499 (nginx's "client closed
request"), once the request stopped; one that ended with no answer at all, `-`.
--disable-access-log-for-endpoints (vLLM's name) leaves out paths that probes and scrapers call all day.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("apiserver.access")


class AccessLogMiddleware:
    """Outermost, so its time covers everything the app does, and its line every status the app answers."""

    def __init__(self, app, excluded_paths: tuple[str, ...]):
        self.app = app
        self._excluded = frozenset(excluded_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self._excluded:
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = "-"

        def logged_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log.info('%s - "%s %s HTTP/%s" %s %.3f s', _client(scope), scope["method"], _target(scope),
                     scope["http_version"], status, time.monotonic() - started)


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _target(scope) -> str:
    """The path and query as sent (no byte of it a line break: HTTP's parser refuses those), a `"` escaped as %22
    so that the quoted request line ends where it seems to."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    return (path + b"?" + query if query else path).decode("latin-1").replace('"', "%22")
