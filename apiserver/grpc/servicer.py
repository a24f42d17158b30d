"""The `vllm.grpc.engine.VllmEngine` service: one method per RPC of vllm_engine.proto.

Every call ends with a status the client can act on: INVALID_ARGUMENT for a malformed or unacceptable request
(with a message that names the field), UNAUTHENTICATED without the API key, RESOURCE_EXHAUSTED at the admission
limits, UNAVAILABLE once the engine is gone, UNIMPLEMENTED for what this server does not do (Embed, profiling,
KV-event streams), INTERNAL (details in the log) for a bug. Every status is counted for the metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from apiserver.api_keys import ApiKeys, api_keys_of
from apiserver.context import ServerContext
from apiserver.engine_errors import EngineDeadError
from apiserver.grpc.generate import RunningRequests, generate
from apiserver.grpc.info import TokenizerBundle, loads, model_info, server_info
from apiserver.grpc.messages import unwrapped
from apiserver.grpc.request import constrain, parse_generate
from apiserver.grpc.status import Code, RpcError, as_rpc_error

log = logging.getLogger(__name__)

UTILITY_TIMEOUT = 10.0


class VllmEngineService:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.running = RunningRequests()
        self.started = time.time()
        self._api_keys = ApiKeys(api_keys_of(ctx.config))
        self._model_info = model_info(ctx)
        self._tokenizer = TokenizerBundle(ctx.model.model_dir)

    # Generation.
    async def Generate(self, request, context):
        async with _Call(self, request, context) as received:
            request = received.message
            call = parse_generate(request, received.metadata, self.ctx.model, self.ctx.config)
            self._check_engine()
            await constrain(call, self.ctx.grammars, self.ctx.config.max_structured_output_choices)
            if call.request_id != request.request_id:
                # The id it got, for the record: trailing metadata travels with the status, at no extra cost (to
                # stop a call it did not name, a client cancels it).
                context.set_trailing_metadata((("x-request-id", call.request_id),))
            async with contextlib.aclosing(generate(self.ctx, call, self.running)) as responses:
                async for response in responses:
                    yield response

    async def Abort(self, request, context):
        return await self._answer(request, context, self._abort)

    def _abort(self, request) -> pb.AbortResponse:
        found = self.running.abort(request.request_ids)
        log.debug("Abort %s: %d call(s) of this server", list(request.request_ids), found)
        return pb.AbortResponse()

    # Health and information.
    async def HealthCheck(self, request, context):
        return await self._answer(request, context, self._health, open_to_all=True)

    def _health(self, request) -> pb.HealthCheckResponse:
        reason = self.ctx.unavailable_reason()
        return pb.HealthCheckResponse(healthy=reason is None, message=reason or "healthy")

    async def GetModelInfo(self, request, context):
        return await self._answer(request, context, lambda request: self._model_info)

    async def GetServerInfo(self, request, context):
        return await self._answer(
            request, context, lambda request: server_info(self.ctx, self.started, self.running.last_arrival)
        )

    async def GetLoads(self, request, context):
        return await self._answer(request, context, lambda request: loads(self.ctx, request))

    async def FlushCache(self, request, context):
        return await self._answer(request, context, self._flush_cache)

    async def _flush_cache(self, request) -> common_pb2.FlushCacheResponse:
        """The engine drops its prefix cache at once, running requests or not (blocks in use are kept), so
        `timeout_s` has nothing to wait for."""
        engine = self.ctx.engine
        await asyncio.gather(*(engine.call_utility(r, "reset_prefix_cache", timeout=UTILITY_TIMEOUT)
                               for r in range(engine.num_engines)))
        return common_pb2.FlushCacheResponse(success=True, message=f"prefix cache reset on {engine.num_engines} "
                                                                   f"engine core(s)")

    async def GetTokenizer(self, request, context):
        async with _Call(self, request, context):
            chunks = self._tokenizer.chunks()
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                yield common_pb2.GetTokenizerChunk(data=chunk, sha256=self._tokenizer.sha256 if last else "")

    # Not served here.
    async def Embed(self, request, context):
        return await self._unimplemented(context, "Embed: this server serves a generative model, not embeddings")

    async def StartProfile(self, request, context):
        return await self._unimplemented(context, "StartProfile: profiling is not available on this server")

    async def StopProfile(self, request, context):
        return await self._unimplemented(context, "StopProfile: profiling is not available on this server")

    async def SubscribeKvEvents(self, request, context):
        await self._unimplemented(context, "SubscribeKvEvents: this server publishes no KV cache events; "
                                           "poll GetLoads for the engines' load")
        yield  # an async generator, as a server-streaming method must be

    # The steps every call shares.
    def authorized(self, metadata: dict, given: int = 1) -> bool:
        """The keys are compared as the HTTP API compares them (apiserver/api_keys.py); `given`: how many
        `authorization` entries the call has (more than one is refused, as over HTTP: which one counts is up to
        whoever reads it)."""
        if not self._api_keys:
            return True
        if given > 1:
            return False
        value = metadata.get("authorization", "")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and self._api_keys.match(token.strip().encode())

    def _check_engine(self) -> None:
        reason = self.ctx.engine_dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)

    async def _answer(self, request, context, produce, open_to_all: bool = False):
        """A unary call: produce its answer (a value or an awaitable) from the request."""
        async with _Call(self, request, context, open_to_all) as received:
            answer = produce(received.message)
            return await answer if asyncio.iscoroutine(answer) else answer

    async def _unimplemented(self, context, message: str) -> None:
        self.ctx.metrics.count_grpc(Code.UNIMPLEMENTED.name)
        await context.abort(Code.UNIMPLEMENTED, message)



class _Call:
    """Around every call (`async with`, giving itself: the call's `message` and its `metadata` as a dict): refuse a
    message its deserializer refused (apiserver/grpc/messages.py) or a missing API key, end the call with the
    status of what went wrong, and count the status. It keeps what the deserializer gave to the call's end (a large
    message's budget with it). A class rather than an @asynccontextmanager: it runs for every call, and a
    generator-based one costs several times more."""

    __slots__ = ("_service", "_request", "_context", "_open", "message", "metadata")

    def __init__(self, service: VllmEngineService, request, context, open_to_all: bool = False):
        self._service = service
        self._request = request
        self._context = context
        self._open = open_to_all

    async def __aenter__(self) -> _Call:
        try:
            self.message = unwrapped(self._request)
        except RpcError as refused:
            await self._end(refused)
        pairs = self._context.invocation_metadata() or ()
        self.metadata = dict(pairs)
        if not self._open and not self._service.authorized(self.metadata, _count(pairs, "authorization")):
            await self._end(RpcError(Code.UNAUTHENTICATED, "missing or invalid API key: send `authorization: Bearer "
                                                           "<key>` metadata"))
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self._service.ctx.metrics.count_grpc("OK")
        elif issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):  # ended by the client or its deadline
            self._service.ctx.metrics.count_grpc(self._ended_by())
        elif not issubclass(exc_type, grpc.aio.AbortError) and issubclass(exc_type, Exception):
            error = as_rpc_error(exc)
            if error is None:
                log.error("unexpected error in a gRPC call", exc_info=exc)
                error = RpcError(Code.INTERNAL, "internal error: the server could not complete the call; see its log")
            await self._end(error)
        return False

    def _ended_by(self) -> str:
        """The status of a call grpcio cancelled: DEADLINE_EXCEEDED where its deadline has passed (what the client
        reads then; a server too slow for its clients is not the same as clients that left), else CANCELLED."""
        remaining = self._context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"

    async def _end(self, error: RpcError) -> None:
        """Count the status and end the call with it (context.abort raises AbortError: nothing runs after)."""
        self._service.ctx.metrics.count_grpc(error.code.name)
        await self._context.abort(error.code, error.message)


def _count(pairs, name: str) -> int:
    return sum(1 for key, _ in pairs if key == name)
