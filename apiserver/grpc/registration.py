"""The services on the gRPC server: VllmEngine (every method of the published proto, read from its descriptor),
the standard health service and server reflection, so grpcurl-style tools and Kubernetes gRPC probes work.

The request deserializers never raise: grpcio would answer a message that does not parse with INTERNAL, while
it is the client's mistake (INVALID_ARGUMENT); the handler gets a `Malformed` and says so.
"""
from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2 as pb

from apiserver.grpc.servicer import Malformed, VllmEngineService

SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"]
SERVICE_NAME = SERVICE.full_name  # vllm.grpc.engine.VllmEngine
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _tolerant(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(exc)

    return deserialize


def _method_handlers(service: VllmEngineService) -> dict:
    handlers = {}
    for method in SERVICE.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=_tolerant(request_type.FromString),
            response_serializer=response_type.SerializeToString,
        )
    return handlers


def add_services(server: grpc.aio.Server, service: VllmEngineService) -> health.aio.HealthServicer:
    """Registers everything on `server`; returns the health servicer, whose status the caller keeps current."""
    handlers = _method_handlers(service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # looked up without a generic handler's walk
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    return health_servicer
