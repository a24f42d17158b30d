"""The route table: each path to its handler. Generation goes to the serving objects (one per endpoint);
the small routes live in info_routes and serving_tokenize. Handlers raise; the app's exception handlers
(apiserver/errors.py) answer."""
from __future__ import annotations

import logging
import os

import orjson
from starlette.requests import Request
from starlette.routing import Route

from apiserver.context import ServerContext
from apiserver.errors import InvalidRequest
from apiserver.gateway_routes import GatewayRoutes
from apiserver.info_routes import DevRoutes, InfoRoutes
from apiserver.serving_chat import ChatServing
from apiserver.serving_completion import CompletionServing
from apiserver.serving_responses import ResponsesServing
from apiserver.serving_tokenize import TokenizeServing
from apiserver.validation import parsing, request_body

log = logging.getLogger(__name__)

DEV_MODE_ENV = "SUPERVISE_DEV_MODE"


class Invocations:
    """POST /invocations (SageMaker): the body's shape picks the endpoint, served by the same objects."""

    def __init__(self, chat: ChatServing, completion: CompletionServing):
        self._chat = chat
        self._completion = completion

    async def create(self, request: Request):
        raw = await request_body(request)
        try:
            async with parsing(raw):
                body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("/invocations needs a JSON object with `messages` (a chat completion) or `prompt` "
                                 "(a completion).")
        rewritten = None
        if "model" not in body:  # SageMaker's payloads name no model: the one this server serves (as vLLM does)
            body["model"] = self._chat.ctx.model_name
            rewritten = orjson.dumps(body)
        if "messages" in body:
            return await self._chat.create(request, rewritten)  # else the body stays cached on the request
        if "prompt" in body:
            return await self._completion.create(request, rewritten)
        raise InvalidRequest("/invocations needs `messages` (a chat completion) or `prompt` (a completion).")


def route_table(ctx: ServerContext) -> list[tuple[str, object, list[str], str]]:
    """(path, handler, methods, summary) for every route this server has with its configuration."""
    chat = ChatServing(ctx)
    completion = CompletionServing(ctx)
    tokenize = TokenizeServing(ctx, chat)
    info = InfoRoutes(ctx)
    gateway = GatewayRoutes(ctx)
    table = [
        ("/v1/chat/completions", chat.create, ["POST"], "Create a chat completion"),
        ("/v1/completions", completion.create, ["POST"], "Create a completion"),
        ("/v1/responses", ResponsesServing(chat).create, ["POST"], "Create a response (OpenAI's Responses API; "
                                                                      "nothing stored)"),
        ("/v1/models", info.models, ["GET"], "List the served model"),
        ("/v1/models/{model:path}", info.model, ["GET"], "The served model's card (404 for any other)"),
        ("/health", info.health, ["GET"], "200 while the engine is alive, else 503"),
        ("/ping", info.health, ["GET", "POST"], "SageMaker health check: as /health"),
        ("/invocations", Invocations(chat, completion).create, ["POST"], "SageMaker: chat or completion by the body's shape"),
        ("/tokenize", tokenize.tokenize, ["POST"], "Token ids of a prompt or of chat messages"),
        ("/detokenize", tokenize.detokenize, ["POST"], "Text of token ids"),
        ("/version", info.version, ["GET"], "The server's version"),
        ("/load", info.load, ["GET"], "Requests in flight in this API server, and every rank's load"),
        ("/metrics", info.metrics, ["GET"], "Prometheus metrics of the whole group"),
        ("/get_server_info", gateway.server_info, ["GET"], "For gateways: the model and the data-parallel ranks"),
        ("/get_model_info", gateway.model_info, ["GET"], "For gateways: the model's facts"),
    ]
    if ctx.config.enable_tokenizer_info_endpoint:
        table.append(("/tokenizer_info", tokenize.tokenizer_info, ["GET"], "The tokenizer's configuration"))
    if not ctx.config.disable_docs:
        table.append(("/openapi.json", info.openapi, ["GET"], "This API's OpenAPI description"))
        table.append(("/docs", info.docs, ["GET"], "This API's documentation page"))
    if os.environ.get(DEV_MODE_ENV) == "1":
        if ctx.index == 0:
            log.warning("%s=1: development routes /server_info and /reset_prefix_cache are open", DEV_MODE_ENV)
        dev = DevRoutes(ctx)
        table.append(("/server_info", dev.server_info, ["GET"], "Development: configuration and engine stats"))
        table.append(("/reset_prefix_cache", dev.reset_prefix_cache, ["POST"], "Development: drop the prefix cache"))
    return table


def build_routes(ctx: ServerContext) -> list[Route]:
    table = route_table(ctx)
    ctx.openapi_routes = [(path, method.lower(), summary) for path, _, methods, summary in table for method in methods]
    return [Route(path, handler, methods=methods) for path, handler, methods, _ in table]
