"""The routes that do not generate: model list, health, version, load, metrics, the API's description,
and the development routes (only with SUPERVISE_DEV_MODE=1)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from apiserver.context import ServerContext
from apiserver.engine_errors import EngineDeadError
from apiserver.errors import ModelNotFound, as_api_error, error_response
from apiserver.api_keys import api_keys_of
from apiserver.openapi import DOCS_PAGE, openapi_schema, package_version

UTILITY_TIMEOUT = 10.0


def json_response(body, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


class InfoRoutes:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self._openapi: bytes | None = None

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """One model's card (OpenAI's GET /v1/models/{model}, the openai package's models.retrieve): the served
        one, else 404 model_not_found. vLLM has no such route."""
        name = request.path_params["model"]
        if not name:  # /v1/models/: a path this server does not have, as any unknown one (not a model named "")
            raise HTTPException(404)
        if name != self.ctx.model_name:
            raise ModelNotFound(name)
        return json_response(self._card())

    def _card(self) -> dict:
        """vLLM's model card: `root` is the model's path (as given, or the embedded model's directory),
        `permission` the one permission object OpenAI's old model objects carried."""
        ctx = self.ctx
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "supervise",
            "root": ctx.config.model or ctx.model.model_dir,
            "parent": None,
            "max_model_len": ctx.model.max_model_len,
            "permission": [{
                "id": f"modelperm-{ctx.created:x}", "object": "model_permission", "created": ctx.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False,
            }],
        }

    async def health(self, request: Request) -> Response:
        # 503 from the first missed engine ping, not only once the engine is dead: a frozen engine would
        # otherwise keep a load balancer sending requests that hang. With several ranks: 503 once none serves,
        # or once any is down while the group is about to go down for it (--on-engine-failure exit).
        ctx = self.ctx
        reason = ctx.unavailable_reason()
        if reason is None and ctx.config.on_engine_failure == "exit" and ctx.engine.down:
            reason = next(iter(ctx.engine.down.values()))
        if reason is not None:
            return error_response(as_api_error(EngineDeadError(reason)))
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": package_version()})

    async def load(self, request: Request) -> Response:
        """vLLM's `server_load`, and every data-parallel rank as this API server sees it."""
        self.ctx.sync_down_ranks()
        return json_response({"server_load": self.ctx.server_load, "engines": self.ctx.engine.rank_views()})

    async def metrics(self, request: Request) -> Response:
        self.ctx.sync_down_ranks()
        text = self.ctx.metrics.exposition(self.ctx.group, self.ctx.model_name, self.ctx.engine.rank_views())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = orjson.dumps(openapi_schema(self.ctx.openapi_routes, bool(api_keys_of(self.ctx.config))))
        return Response(self._openapi, media_type="application/json")

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(DOCS_PAGE)


class DevRoutes:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def server_info(self, request: Request) -> Response:
        ctx = self.ctx
        engine = ctx.engine
        ctx.sync_down_ranks()
        stats = await asyncio.gather(
            *(engine.call_utility(i, "stats", timeout=UTILITY_TIMEOUT) for i in range(engine.num_engines)),
            return_exceptions=True,
        )
        config = dataclasses.asdict(ctx.config)
        config["api_key"] = "<set>" if config.get("api_key") else None
        engines = []
        for view, stat in zip(engine.rank_views(), stats):
            # The engine's own answer wins over this server's view of it; a rank that is down says why.
            engines.append({**view, **(stat if isinstance(stat, dict) else {"error": str(stat) or type(stat).__name__})})
        return json_response({
            "api_server": {
                "index": ctx.index, "pid": os.getpid(), "in_flight": engine.num_in_flight,
                # The top-level packages this process has imported: what a test checks the import graph with.
                "packages": sorted({name.partition(".")[0] for name in sys.modules}),
            },
            "config": config,
            "model": dataclasses.asdict(ctx.model),
            "engines": engines,
        })

    async def reset_prefix_cache(self, request: Request) -> Response:
        engine = self.ctx.engine
        await asyncio.gather(
            *(engine.call_utility(i, "reset_prefix_cache", timeout=UTILITY_TIMEOUT) for i in engine.usable())
        )
        return Response(status_code=200)
