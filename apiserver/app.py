"""The ASGI application of one API server: routes, middleware, errors in the OpenAI format, and the count of
every answer's status for /metrics around all of it (and around that, the access log where asked for)."""
from __future__ import annotations

from starlette.applications import Starlette

from apiserver.access_log import AccessLogMiddleware
from apiserver.context import ServerContext
from apiserver.errors import exception_handlers
from apiserver.middleware import StatusCountMiddleware, middleware_stack
from apiserver.routes import build_routes


def build_app(ctx: ServerContext) -> StatusCountMiddleware | AccessLogMiddleware:
    app = Starlette(
        routes=build_routes(ctx),
        middleware=middleware_stack(ctx.config),
        exception_handlers=exception_handlers(),
    )
    # A path with a slash too many is an unknown route, the router's 404 in the OpenAI format, not
    # Starlette's 307 to the same path without it (built from the client's Host header).
    app.router.redirect_slashes = False
    counted = StatusCountMiddleware(app, ctx.metrics)
    if ctx.config.access_log:
        return AccessLogMiddleware(counted, ctx.config.disable_access_log_for_endpoints)
    return counted
