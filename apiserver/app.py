"""The Starlette application of one API server: routes, middleware, and errors in the OpenAI format."""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from apiserver.context import ServerContext
from apiserver.errors import starlette_exception_handler
from apiserver.middleware import middleware_stack
from apiserver.routes import build_routes


def build_app(ctx: ServerContext) -> Starlette:
    app = Starlette(
        routes=build_routes(ctx),
        middleware=middleware_stack(ctx.config),
        exception_handlers={HTTPException: starlette_exception_handler, Exception: starlette_exception_handler},
    )
    app.state.ctx = ctx
    return app
