"""What a gateway in front probes before it sends work: SGLang's info routes, which smg reads when it treats a
worker as data-parallel aware (`--dp-aware` with the worker registered as runtime_type "sglang").

smg reads `dp_size` from /get_server_info (after a 404 from /server_info, which here is a development route),
then sends each request with the body field `data_parallel_rank` (0 .. dp_size-1) that
apiserver/serving.py honours like vLLM's X-data-parallel-rank header. Only facts /v1/models already tells are
here: the model, its length, the ranks; no configuration.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from apiserver.context import ServerContext
from apiserver.info_routes import json_response


class GatewayRoutes:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def server_info(self, request: Request) -> Response:
        ctx = self.ctx
        ranks = ctx.engine.ranks
        body = {
            "model_path": ctx.config.model or ctx.model_name,
            "served_model_name": ctx.model_name,
            "max_model_len": ctx.model.max_model_len,
            "data_parallel_size": ctx.config.data_parallel_size,
            "data_parallel_ranks": ranks,
        }
        # dp_size means "pin with ranks 0 .. dp_size-1": true only of a group that serves ranks from 0.
        if ranks == list(range(len(ranks))):
            body["dp_size"] = len(ranks)
        return json_response(body)

    async def model_info(self, request: Request) -> Response:
        ctx = self.ctx
        return json_response({
            "model_path": ctx.config.model or ctx.model_name,
            "served_model_name": ctx.model_name,
            "is_generation": True,
            "max_context_length": ctx.model.max_model_len,
            "vocab_size": ctx.model.vocab_size,
            "eos_token_ids": list(ctx.model.eos_token_ids),
        })
