"""Entry point of a gRPC API server process (`supervise --grpc`), started by the supervisor with `spawn`.

CONTRACT: the HTTP API server's (apiserver/process.py), the same one argument (ipc.launch.ApiServerLaunch) and
the same duties: process title `supervise: ApiServer_<index>`, its shared-memory slot, a heartbeat from the
event loop, READY once it serves, exit code 3 when an engine stops answering, SIGTERM drains (running calls
finish, up to --shutdown-timeout), a second SIGTERM stops at once.

One difference: `launch.listen_socket` is the supervisor's reservation of the port, bound but never listening
(supervisor/grpc_mode.py). grpcio cannot adopt a socket, so this server binds its own on the same address with
SO_REUSEPORT and the kernel spreads new connections over the group's servers. During a rolling restart the
replacement binds and serves before its predecessor drains; a draining server stops listening and sends its
connections GOAWAY, so clients reconnect to the servers that still listen.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

# grpcio's core logs each failed TLS handshake on stderr at INFO, past our format and our throttle: a client that
# sends plain bytes to a TLS port wrote 2,000 lines in 0.3 s. Its errors only, unless the operator says otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402
import uvloop

from apiserver.admission import AdmissionControl
from apiserver.context import ServerContext
from apiserver.engine_client import EngineClient
from apiserver.engine_watch import watch_engines
from apiserver.grpc.metrics_http import serve_metrics
from apiserver.grpc.registration import NOT_SERVING, SERVICE_NAME, SERVING, add_services
from apiserver.grpc.servicer import VllmEngineService
from apiserver.large_body_budget import LargeBodyBudget
from apiserver.metrics import Metrics
from apiserver.process import ENGINE_GONE_EXIT_CODE, enter_process, reach_engines
from apiserver.server import StopSignals, beat_forever
from ipc.config import ServeConfig
from ipc.heap import freeze_start_up
from ipc.tls import kept_files
from ipc.launch import ApiServerLaunch
from ipc.lifeline import supervisor_gone

log = logging.getLogger("apiserver")
# The loop holds only weak references to tasks: these keep the fire-and-forget ones alive until they finish.
_background: set[asyncio.Future[None]] = set()


def _in_background(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


SERVER_OPTIONS = (
    ("grpc.so_reuseport", 1),  # the group's servers share the port (grpcio's default, stated)
    ("grpc.max_send_message_length", -1),  # what we send is ours to size (the tokenizer comes in chunks anyway)
    # Gateways keep their channel alive with pings, also between calls and while a long non-streamed call
    # sends nothing; without these grpcio answers such pings with GOAWAY "too_many_pings".
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class _GoneClientWrites(logging.Filter):
    """grpcio logs, at ERROR with a traceback, a response written to a call whose client has just gone (cancelled,
    killed): "ExecuteBatchError raised in core by servicer method". That is a client leaving, which the call's own
    handling counts (CANCELLED) and the engine aborts; not an error of the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[0] is not None
                    and record.exc_info[0].__name__ == "ExecuteBatchError")


def run_grpc_api_server(launch: ApiServerLaunch) -> None:
    config, index, model = launch.config, launch.index, launch.model
    stop, group = enter_process(launch)
    logging.getLogger("grpc._cython.cygrpc").addFilter(_GoneClientWrites())
    launch.listen_socket.close()  # the supervisor's reservation stays with the supervisor
    engine = EngineClient.for_launch(launch, group)
    ctx = ServerContext(
        config=config, index=index, model=model, renderer=None, engine=engine, group=group,
        admission=AdmissionControl(group, index, config.max_num_queued_reqs, config.max_num_queued_tokens),
        metrics=Metrics(config.runtime_dir, index, config.metrics_names),
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        exit_code = runner.run(_serve(ctx, launch.ready, stop))
    group.close()
    log.info("stopped")
    if exit_code:
        raise SystemExit(exit_code)


async def _serve(ctx: ServerContext, ready, stop: StopSignals) -> int:
    config, engine = ctx.config, ctx.engine
    health = _HealthReport(ctx)
    heartbeat = asyncio.create_task(beat_forever(ctx.group, ctx.index, health.update), name="heartbeat")
    try:
        ctx.sync_down_ranks()  # a rank already down is neither pinged nor sent work
        await reach_engines(engine)
        # --max-request-body-bytes bounds a request message, as it bounds an HTTP body.
        server = grpc.aio.server(
            options=(*SERVER_OPTIONS, ("grpc.max_receive_message_length", config.max_request_body_bytes),
                     # A TLS handshake has --timeout-request-header, as over HTTP: grpcio's own bound is 120 s, for
                     # which a client that sent half a ClientHello held a connection.
                     ("grpc.server_handshake_timeout_ms", int(config.timeout_request_header * 1000)))
        )
        health.servicer = add_services(server, VllmEngineService(ctx),
                                       LargeBodyBudget(config.max_large_request_bodies_mb))
        await health.servicer.set(SERVICE_NAME, SERVING)
        host = f"[{config.host}]" if ":" in config.host else config.host
        if config.ssl_certfile:
            server.add_secure_port(f"{host}:{config.port}", tls_credentials(config))
        else:
            server.add_insecure_port(f"{host}:{config.port}")
        await server.start()
        metrics_server = None
        if config.metrics_port is not None:
            metrics_server = await serve_metrics(config.host, config.metrics_port, lambda: ctx.metrics.exposition(
                ctx.group, ctx.model_name, ctx.engine.rank_views()))
        freeze_start_up()
        ready.send(True)
        stopping = _StopRequests(server, stop)
        watcher = asyncio.create_task(watch_engines(engine, config.engine_ping_interval, stopping.engine_gone,
                                                     ctx.sync_down_ranks),
                                      name="engine-watch")
        await stopping.wait()
        watcher.cancel()
        await health.servicer.enter_graceful_shutdown()
        if metrics_server is not None:
            metrics_server.close()
        await server.stop(config.shutdown_timeout)
        return ENGINE_GONE_EXIT_CODE if stopping.gone else 0
    finally:
        heartbeat.cancel()
        await ctx.grammars.close()
        await engine.close()


class _StopRequests:
    """SIGTERM/SIGINT start the drain; a second one, or any once the supervisor is gone, cuts it short (running
    calls are cancelled). An engine that stopped answering drains the server too, and the process then exits
    with ENGINE_GONE_EXIT_CODE."""

    def __init__(self, server: grpc.aio.Server, early: StopSignals):
        self._server = server
        self._event = asyncio.Event()
        self.gone: str | None = None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        if early.received:  # read after our handlers took over: a signal is seen by one or the other
            self._event.set()

    def _on_signal(self) -> None:
        if self._event.is_set() or supervisor_gone():
            log.warning("%s: cancelling the calls still running",
                        "the supervisor is gone" if supervisor_gone() else "second stop signal")
            _in_background(self._server.stop(None))
        self._event.set()

    def engine_gone(self, reason: str) -> None:
        log.error("stopping: %s", reason)
        self.gone = reason
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


class _HealthReport:
    """Each heartbeat: the standard health service says NOT_SERVING while the engine is dead or not answering
    its pings (what the HTTP server's /health says with 503), SERVING again once it answers."""

    def __init__(self, ctx: ServerContext):
        self._ctx = ctx
        self.servicer = None  # grpc_health's aio HealthServicer, once the server exists
        self._status = SERVING

    def update(self) -> None:
        if self.servicer is None:
            return
        reason = self._ctx.unavailable_reason()
        status = SERVING if reason is None else NOT_SERVING
        if status != self._status:
            self._status = status
            for service in ("", SERVICE_NAME):
                _in_background(self.servicer.set(service, status))


def tls_credentials(config: ServeConfig) -> grpc.ServerCredentials:
    """--ssl-*: grpcio's TLS, from the bytes of the files' checked copy (ipc.tls.kept_files)."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    certfile, keyfile, ca_certs = kept_files(config)
    certificate = read(certfile)
    key = read(keyfile) if keyfile else certificate  # or in the certificate's file
    return grpc.ssl_server_credentials([(key, certificate)],
                                       root_certificates=read(ca_certs) if ca_certs else None,
                                       require_client_auth=config.ssl_cert_reqs == 2)
