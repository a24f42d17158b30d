"""What `--grpc` changes on the supervisor's side: which options make sense, and how the ports are held.

grpcio cannot adopt a listening socket: each gRPC API server binds its own, with SO_REUSEPORT, and the kernel
spreads new connections over them. The supervisor still takes the port first, so a busy port fails at once and
a group restart never frees it, but it only *binds* its socket (same SO_REUSEPORT flag), never `listen()`s on
it: a TCP socket joins the port's SO_REUSEPORT group when it listens, so a bound-only socket holds the port
without being handed connections that nobody would accept. The same goes for `--metrics-port`.
"""
from __future__ import annotations

import os
import socket

from ipc.config import ServeConfig
from supervisor.listen_socket import bind_shared_port

# Options of the HTTP front end that mean nothing to a gRPC API server: set with --grpc, they are refused
# rather than silently ignored.
HTTP_ONLY_OPTIONS = (
    "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "enable_request_id_headers",
    "disable_docs", "sse_keep_alive_interval", "enable_prompt_tokens_details", "enable_tokenizer_info_endpoint",
    "enable_server_load_tracking", "access_log", "disable_access_log_for_endpoints", "middleware", "timeout_keep_alive",
    "accept_backoff_ms", "write_batching", "direct_stream_events",
    # Chat rendering, tools and reasoning: with --grpc the gateway renders and parses (smg has these options).
    "chat_template", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "tokenizer_word_cache",
)


def option_conflict(config: ServeConfig) -> str | None:
    """Why this combination of options cannot run, in one line; None when it can."""
    if not config.grpc:
        if config.metrics_port is not None:
            return "--metrics-port goes with --grpc (the HTTP API serves GET /metrics on --port)"
        return None
    defaults = ServeConfig()
    for name in HTTP_ONLY_OPTIONS:
        if getattr(config, name) != getattr(defaults, name):
            return f"--{name.replace('_', '-')} applies to the HTTP API; it has no effect with --grpc"
    if config.metrics_port is not None and config.metrics_port == config.port and config.port != 0:
        return "--metrics-port must differ from --port"
    return None


class SocketActivationUnsupported(OSError):
    pass


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT and never listening: the port is ours, connections go to
    the gRPC API servers that bind it too. Raises PortInUse when another process holds the port."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()):
        raise SocketActivationUnsupported(
            "--grpc cannot take a socket from systemd (grpcio binds its own): run it without the .socket unit"
        )
    return bind_shared_port(host, port)
