"""The group's children: how each is spawned, and what the supervisor keeps to watch and stop it."""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from ipc.config import ServeConfig
from ipc.model_info import ModelInfo
from supervisor.child_entry import run_child

log = logging.getLogger(__name__)

ENGINE_ENTRY = "enginecore.process:run_engine_core"
# A benchmark instrument, never the default: `--model sim:<ms per step>` paces tokens without a model.
SIMULATED_ENGINE_ENTRY = "enginecore.simulated:run_simulated_engine_core"
API_SERVER_ENTRY = "apiserver.process:run_api_server"
# --grpc: the same API server role (same contract, heartbeat, restart and drain) speaking gRPC instead of HTTP.
GRPC_API_SERVER_ENTRY = "apiserver.grpc.process:run_grpc_api_server"


@dataclass
class Child:
    name: str  # EngineCore_DP0, ApiServer_3: the names the logs and process titles use
    kind: str  # "engine" | "api"
    index: int
    process: BaseProcess
    ready_conn: Connection  # the child sends one record here once it serves (or why it cannot)
    lifeline: Connection  # we hold the only write end; it closes when we die, whatever kills us
    started_at: float = field(default_factory=time.monotonic)
    ready: bool = False
    stopping: bool = False  # we asked it to stop: its exit is expected

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def signal(self, signum: int) -> None:
        if self.alive and self.process.pid:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.stopping = True
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.stopping = True
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        for conn in (self.ready_conn, self.lifeline):
            try:
                conn.close()
            except OSError:
                pass


def _spawn(ctx: SpawnContext, name: str, kind: str, index: int, entry: str, make_args) -> Child:
    """make_args(ready, lifeline) -> the entry point's arguments, in the order its contract gives."""
    ready_read, ready_write = ctx.Pipe(duplex=False)
    lifeline_read, lifeline_write = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=run_child, args=(entry, *make_args(ready_write, lifeline_read)), name=name, daemon=False
    )
    process.start()
    # The child has its own copies now; ours would keep the pipes open after the child died.
    ready_write.close()
    lifeline_read.close()
    log.info("started %s (pid %d)", name, process.pid)
    return Child(name, kind, index, process, ready_read, lifeline_write)


def spawn_engine_core(ctx: SpawnContext, config: ServeConfig, rank: int) -> Child:
    entry = SIMULATED_ENGINE_ENTRY if (config.model or "").startswith("sim:") else ENGINE_ENTRY
    return _spawn(
        ctx, f"EngineCore_DP{rank}", "engine", rank, entry, lambda ready, lifeline: (config, rank, ready, lifeline)
    )


def spawn_api_server(
    ctx: SpawnContext,
    config: ServeConfig,
    index: int,
    listen_socket: socket.socket,
    model: ModelInfo,
    engine_addresses: list[str],
    shared_state_name: str,
    group_lock,
) -> Child:
    return _spawn(
        ctx,
        f"ApiServer_{index}",
        "api",
        index,
        GRPC_API_SERVER_ENTRY if config.grpc else API_SERVER_ENTRY,
        lambda ready, lifeline: (
            config, index, listen_socket, model, engine_addresses, shared_state_name, group_lock, lifeline, ready
        ),
    )
