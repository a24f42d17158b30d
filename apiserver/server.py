"""uvicorn around the app, on the group's already-listening socket, and the loop's heartbeat.

`build_http_server` is the one place that decides which uvicorn Server runs: uvicorn's protocol classes
(httptools) behind the group's balanced accept loop (apiserver/accept_loop.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from apiserver.accept_loop import BalancedServer
from ipc.config import ServeConfig
from ipc.shared_state import GroupState

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0


class ApiHttpServer(BalancedServer):
    """A second SIGTERM or SIGINT stops at once (uvicorn itself forces only on a second SIGINT)."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)


def build_http_server(app, config: ServeConfig, group: GroupState, index: int) -> uvicorn.Server:
    uv_config = uvicorn.Config(
        app,
        http="httptools",
        lifespan="off",  # the process entry sets everything up before serving
        log_config=None,  # keep ipc.logs' format
        access_log=False,
        server_header=False,
        proxy_headers=False,  # nothing here reads the client address; one ASGI layer less per request
        timeout_graceful_shutdown=config.shutdown_timeout,
        timeout_keep_alive=30,
    )
    return ApiHttpServer(uv_config, group, index, config.accept_backoff_ms / 1000.0)


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
