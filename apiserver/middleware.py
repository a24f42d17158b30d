"""The HTTP middleware, outermost first: the status counter (around the whole app), then in the app's stack
CORS, the body limit, the API key, X-Request-Id, then the user's own.

Ours are bare ASGI callables (no BaseHTTPMiddleware): they run on every request, so they must cost next to
nothing when they have nothing to do.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

import orjson
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware

from apiserver.api_keys import ApiKeys, api_keys_of
from apiserver.errors import (REQUEST_ID_SCOPE_KEY, ApiError, LargeBodiesFull, RequestTooLarge, Unauthorized, error_body,
                              error_response)
from apiserver.large_body_budget import LargeBodyBudget
from apiserver.metrics import Metrics
from apiserver.validation import LARGE_BODY_BYTES
from ipc.config import ServeConfig

log = logging.getLogger(__name__)

# What stays reachable without the API key: probes, metrics, the version, and the API's own description (as
# in vLLM, whose key guards only the API's routes; /docs could not send a key to fetch /openapi.json anyway).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/openapi.json", "/docs"})


class StatusCountMiddleware:
    """Counts every answer's status class for /metrics, whoever made it: a route, an exception handler, the
    API key's 401, the router's 404 and 405, the body limit's 413, Starlette's 500. It wraps the whole app
    (Starlette's own error middleware included), and only looks at the one `http.response.start`."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self._count = metrics.count_status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        count = self._count

        def counted_send(message):  # hands back send's awaitable: no coroutine of its own per event
            if message["type"] == "http.response.start":
                count(message["status"])
            return send(message)

        await self.app(scope, receive, counted_send)


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight (an origin, method or header not allowed) answered in the
    OpenAI error format instead of its plain text, with the same status (400) and CORS headers."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode()  # "Disallowed CORS origin, method"
        headers = {name: value for name, value in response.headers.items()
                   if name not in ("content-length", "content-type")}
        return error_response(ApiError(
            f"{refused}: this server's --allowed-origins, --allowed-methods and --allowed-headers do not allow "
            f"this cross-origin request.", code="cors_disallowed", headers=headers,
        ))


class BodyLimitMiddleware:
    """--max-request-body-bytes: a larger body is refused with 413 before anything parses it, at once when its
    Content-Length says so (the rest of it is never handed to the app), else as soon as the bytes read pass
    the limit (a chunked body).

    --max-large-request-bodies-mb: the bytes read of bodies of LARGE_BODY_BYTES or more count while their requests
    run, to the end of the answer; a body whose next bytes would take the count past `large_limit` is refused
    with 503 (LargeBodiesFull), and one whose Content-Length would is refused at once, unread. Bytes count as they
    are read, not as they are declared: a client that declares large bodies and sends them a byte at a time (the
    body timeout runs between two reads, so a slow link is not cut) holds what it sent, not the limit (four such
    connections held every large body off with 503 for as long as they trickled). One alone always passes;
    small bodies never count."""

    def __init__(self, app, limit: int, large_bodies: LargeBodyBudget):
        self.app = app
        self._limit = limit
        self._large = large_bodies

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"The request body is larger than this server's limit of {self._limit} bytes "
            f"(--max-request-body-bytes).", code="request_too_large"
        )

    def _full(self, size: int, own: int = 0) -> LargeBodiesFull | None:
        """The refusal of `size` more bytes for a body that counts `own` already, if they would pass the limit."""
        refusal = self._large.refusal(size, own)
        return None if refusal is None else LargeBodiesFull(refusal, code="large_request_bodies_full")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit
        for name, value in scope["headers"]:
            if name == b"content-length":  # the HTTP parser holds the body to it
                if not value.isdigit():
                    return await self.app(scope, receive, send)
                length = int(value)
                if length > limit:
                    return await error_response(self._too_large())(scope, receive, send)
                if length < LARGE_BODY_BYTES or not self._large.limit:
                    return await self.app(scope, receive, send)
                if full := self._full(length):
                    return await error_response(full)(scope, receive, send)
                break
        received = counted = 0

        async def counted_receive():
            nonlocal received, counted
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._too_large()  # from the route's `await request.body()`: its handlers answer
                if received >= LARGE_BODY_BYTES and self._large.limit:
                    if full := self._full(received - counted, counted):
                        raise full  # (answered from there too)
                    self._large.take(received - counted)
                    counted = received
            return message

        try:
            await self.app(scope, counted_receive, send)
        finally:
            self._large.give(counted)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route that reaches the model or its tokenizer. The keys are
    compared as apiserver/api_keys.py says."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self._keys = ApiKeys(api_keys)
        self._denied = orjson.dumps(
            error_body(Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"))
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._authorized(scope["headers"]):
            return await self.app(scope, receive, send)
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
        })
        await send({"type": "http.response.body", "body": self._denied})

    def _authorized(self, headers) -> bool:
        """One `Authorization: Bearer <key>` with a key of the group's. Two Authorization headers are refused: a
        proxy on the way may read the other one than this server does."""
        given = [value for name, value in headers if name == b"authorization"]
        if len(given) != 1:
            return False
        scheme, _, token = given[0].partition(b" ")
        return scheme.lower() == b"bearer" and self._keys.match(token.strip())


class RequestIdMiddleware:
    """--enable-request-id-headers: every response carries X-Request-Id. It is the id the request went by: the
    client's header, else (on the generation endpoints) the body's `request_id`, else a new one. The endpoint
    settles it while it reads the body (GenerationServing.request_id, into the scope), so the header is made
    when the response starts."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"x-request-id" and value:
                scope[REQUEST_ID_SCOPE_KEY] = value.decode("latin-1")
                break

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                request_id = scope.get(REQUEST_ID_SCOPE_KEY) or os.urandom(16).hex()
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def user_middleware(spec: str) -> Middleware:
    """`module:object`: a class is used as ASGI middleware, a function as `async def f(request, call_next)`
    (what vLLM's --middleware takes)."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ValueError(f"--middleware {spec!r}: expected module:object")
    obj = getattr(importlib.import_module(module_name), attribute)
    if inspect.isclass(obj):
        return Middleware(obj)
    if callable(obj):
        return Middleware(BaseHTTPMiddleware, dispatch=obj)
    raise ValueError(f"--middleware {spec!r} is neither a class nor a function")




def middleware_stack(config: ServeConfig) -> list[Middleware]:
    stack = []
    if config.allowed_origins:
        stack.append(Middleware(
            CorsMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        ))
    stack.append(Middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes,
                            large_bodies=LargeBodyBudget(config.max_large_request_bodies_mb)))
    api_keys = api_keys_of(config)
    if api_keys:
        stack.append(Middleware(ApiKeyMiddleware, api_keys=api_keys))
    if config.enable_request_id_headers:
        stack.append(Middleware(RequestIdMiddleware))
    stack += [user_middleware(spec) for spec in config.middleware]
    return stack
