"""uvicorn around the app, on the group's already-listening socket, and the loop's heartbeat.

`build_http_server` is the one place that decides which uvicorn Server runs: our connection protocol
(uvicorn's httptools protocol with read timeouts, apiserver/http_connection.py, writing through the loop's
batch of writes, apiserver/write_batch.py) behind the group's balanced accept loop (apiserver/accept_loop.py),
with TLS when --ssl-certfile is given (ipc/tls.py).
Everything else is uvicorn's: its lifespan, its graceful shutdown.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
import time
from collections.abc import Callable

import uvicorn

from apiserver.accept_loop import BalancedAcceptor
from apiserver.http_connection import ConnectionPolicy, HttpConnection
from apiserver.metrics import Metrics
from apiserver.write_batch import WriteBatch
from ipc.config import ServeConfig
from ipc.lifeline import supervisor_gone
from ipc.shared_state import GroupState
from ipc.tls import kept_files, server_context

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
# While draining, an idle keep-alive connection gets this long to bring its next request (answered, then
# closed) before the server closes it: closing an idle connection races with a client sending on it.
IDLE_CONNECTION_GRACE = 1.0
# At --shutdown-timeout the requests still in flight fail (cut_requests), and get this long more to say so to
# their clients before uvicorn cancels what is left (a traceback apiece, and the streams cut without a word).
CUT_REQUESTS_GRACE = 1.0


class ApiHttpServer(uvicorn.Server):
    """uvicorn's Server with our accept loop in place of loop.create_server (uvicorn's graceful shutdown
    calls close() on what it keeps in self.servers), and our drain."""

    def __init__(self, config: uvicorn.Config, policy: ConnectionPolicy, state: GroupState, slot: int,
                 backoff_seconds: float, shutdown_timeout: float, cut_requests: Callable[[str], None] | None,
                 tls: ssl.SSLContext | None = None):
        super().__init__(config)
        self._tls = tls
        self.policy = policy
        self._shutdown_timeout = shutdown_timeout
        self._cut_requests = cut_requests  # EngineClient.fail_in_flight
        self._state = state
        self._slot = slot
        self._backoff = backoff_seconds
        self.acceptor: BalancedAcceptor | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise SystemExit(3)

        def create_protocol() -> asyncio.Protocol:
            return HttpConnection(self.config, self.server_state, self.lifespan.state, self.policy)

        (listen_socket,) = sockets
        self.acceptor = BalancedAcceptor(listen_socket, create_protocol, self._state, self._slot, self._backoff,
                                         self._tls, self.policy.timeout_request_header)
        self.servers = [self.acceptor]
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain without failing a client that can go elsewhere: stop accepting (our copy of the listening
        socket closed), answer every further request with `Connection: close` (with 503 when the whole group
        stops, else served: a successor serves the port), give idle connections a moment to use that, then
        let uvicorn close the rest and wait for the requests in flight."""
        if self.acceptor is not None:
            self.acceptor.close()
        if self._cut_requests is not None:
            asyncio.get_running_loop().call_later(
                self._shutdown_timeout, self._cut_requests,
                f"the server stopped: --shutdown-timeout ({self._shutdown_timeout:g} s) passed before the request "
                "finished")
        self.policy.refusing = self._state.group_stopping()
        self.server_state.default_headers = [*self.server_state.default_headers, (b"connection", b"close")]
        deadline = time.monotonic() + IDLE_CONNECTION_GRACE
        while self.server_state.connections and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """A second SIGTERM or SIGINT stops at once (uvicorn itself forces only on a second SIGINT), and so does
        any once the supervisor is gone."""
        if self.should_exit or supervisor_gone():
            self.force_exit = True
        super().handle_exit(sig, frame)


def build_http_server(app, config: ServeConfig, group: GroupState, index: int, metrics: Metrics,
                      cut_requests: Callable[[str], None] | None = None) -> uvicorn.Server:
    """`cut_requests(reason)`: fails the requests in flight (EngineClient.fail_in_flight), at --shutdown-timeout."""
    uv_config = uvicorn.Config(
        app,
        http="httptools",
        ws="none",  # no route takes a WebSocket: an upgrade is ignored and the request served as HTTP/1.1
        lifespan="off",  # the process entry sets everything up before serving
        log_config=None,  # keep ipc.logs' format
        access_log=False,
        server_header=False,
        proxy_headers=False,  # nothing here reads the client address; one ASGI layer less per request
        timeout_graceful_shutdown=config.shutdown_timeout + (CUT_REQUESTS_GRACE if cut_requests else 0.0),
        timeout_keep_alive=config.timeout_keep_alive,  # uvicorn's own timer, after each response
    )
    # Called on the serving loop: the batch queues its flushes there.
    batch = WriteBatch(asyncio.get_running_loop()) if config.write_batching else None
    # A user's middleware may change a body on its way through `send`: the events must take it.
    direct_body = config.direct_stream_events and not config.middleware
    # The answers the connections make themselves (400, 408) are counted as the app's are.
    policy = ConnectionPolicy(config.timeout_keep_alive, config.timeout_request_header, write_batch=batch,
                              direct_body=direct_body, count_status=metrics.count_status,
                              max_header_bytes=config.max_request_header_bytes)
    tls = None
    if config.ssl_certfile:  # checked by the supervisor before anything started
        tls = server_context(*kept_files(config), config.ssl_cert_reqs)
    return ApiHttpServer(uv_config, policy, group, index, config.accept_backoff_ms / 1000.0, config.shutdown_timeout,
                         cut_requests, tls)


async def beat_forever(group: GroupState, index: int, on_beat=None) -> None:
    """The supervisor's proof that this event loop still runs: a beat every second, from the loop itself."""
    while True:
        group.beat(index)
        if on_beat is not None:
            on_beat()
        await asyncio.sleep(HEARTBEAT_SECONDS)


class StopSignals:
    """SIGTERM/SIGINT before uvicorn serves (and after: uvicorn re-raises what it caught on its way out):
    remember them instead of dying, so the process still ends cleanly with exit code 0."""

    def __init__(self):
        self.received = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True
