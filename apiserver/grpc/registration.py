"""The services on the gRPC server: VllmEngine (every method of the published proto, read from its descriptor),
the standard health service and server reflection, so grpcurl-style tools and Kubernetes gRPC probes work.

Every method reads its messages with apiserver/grpc/messages.py's deserializer, which never raises and counts
large messages. grpcio's own health and reflection services parse with raising deserializers: their handlers are
registered here instead of by grpcio's generated `add_*Servicer_to_server`, each with our deserializer and a
wrapper that ends the call with the status of a refused message (INVALID_ARGUMENT for one that does not parse)
before grpcio's servicer sees it, and hands it the message itself.
"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb

from apiserver.grpc.messages import request_reader, unwrapped
from apiserver.grpc.servicer import VllmEngineService
from apiserver.grpc.status import RpcError
from apiserver.large_body_budget import LargeBodyBudget

SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"]
SERVICE_NAME = SERVICE.full_name  # vllm.grpc.engine.VllmEngine
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _method_handlers(service: VllmEngineService, budget: LargeBodyBudget) -> dict:
    handlers = {}
    for method in SERVICE.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=request_reader(request_type.FromString, budget),
            response_serializer=response_type.SerializeToString,
        )
    return handlers


def add_services(server: grpc.aio.Server, service: VllmEngineService,
                 budget: LargeBodyBudget) -> health.aio.HealthServicer:
    """Registers everything on `server`, their large messages held to `budget`; returns the health servicer,
    whose status the caller keeps current."""
    _register(server, SERVICE_NAME, _method_handlers(service, budget))
    health_servicer = health.aio.HealthServicer()
    _register_refusing(server, health_pb2_grpc.add_HealthServicer_to_server, health_servicer, budget)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection_servicer = reflection.aio.ReflectionServicer((SERVICE_NAME, health_name, reflection.SERVICE_NAME))
    _register_refusing(server, reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection_servicer,
                       budget)
    return health_servicer


def _register(server: grpc.aio.Server, name: str, handlers: dict) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)  # looked up without a generic handler's walk


# grpcio's services, registered with our deserializer.
class _Collected:
    """Stands in for the server while a generated `add_*Servicer_to_server` registers: keeps its handlers."""

    def __init__(self):
        self.services: dict[str, dict] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass  # the same handlers come by name below

    def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
        self.services[name] = handlers


def _register_refusing(server: grpc.aio.Server, add_to_server, servicer, budget: LargeBodyBudget) -> None:
    collected = _Collected()
    add_to_server(servicer, collected)
    for name, handlers in collected.services.items():
        _register(server, name, {method: _refusing(handler, budget) for method, handler in handlers.items()})


def _refusing(handler: grpc.RpcMethodHandler, budget: LargeBodyBudget) -> grpc.RpcMethodHandler:
    """`handler` with our deserializer, its behaviour behind a check of each message it reads."""
    kind = ("stream_" if handler.request_streaming else "unary_") + ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler  # a synchronous default (UNIMPLEMENTED) reads nothing
    return handler._replace(request_deserializer=request_reader(handler.request_deserializer, budget),
                            **{kind: _checked_behavior(behavior, handler.request_streaming)})


def _checked_behavior(behavior, request_streaming: bool):
    """The same kind of callable as `behavior` (grpcio tells a coroutine from an async generator), which hands it
    only messages that were not refused, unwrapped (their wrappers live in these frames to the call's end)."""
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            async for response in behavior(await _checked(request, context, request_streaming), context):
                yield response

        return streaming

    async def unary(request, context):
        return await behavior(await _checked(request, context, request_streaming), context)

    return unary


async def _checked(request, context, request_streaming: bool):
    """The message, or for a request stream the stream with each message checked as it is read."""
    if request_streaming:
        return _checked_stream(request, context)
    return await _message_of(request, context)


async def _checked_stream(requests, context):
    async for request in requests:
        yield await _message_of(request, context)


async def _message_of(request, context):
    try:
        return unwrapped(request)
    except RpcError as refused:
        await context.abort(refused.code, refused.message)
