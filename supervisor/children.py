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

from ipc.anonymous_memory import MemoryHandle
from ipc.config import ServeConfig
from ipc.curve import CurveKeys
from ipc.launch import ApiServerLaunch, EngineLaunch
from ipc.model_info import ModelInfo
from supervisor.child_entry import run_child

log = logging.getLogger(__name__)

ENGINE_ENTRY = "enginecore.process:run_engine_core"  # the real engine, or the simulated one for `--model sim:<ms>`
API_SERVER_ENTRY = "apiserver.process:run_api_server"
# --grpc: the same API server role (same contract, heartbeat, restart and drain) speaking gRPC instead of HTTP.
GRPC_API_SERVER_ENTRY = "apiserver.grpc.process:run_grpc_api_server"


@dataclass(eq=False)  # a child is itself, not its fields
class Child:
    name: str  # EngineCore_DP0, ApiServer_3: the names the logs and process titles use
    kind: str  # "engine" | "api"
    index: int
    process: BaseProcess
    ready_conn: Connection  # the child sends one record here once it serves (or why it cannot)
    lifeline: Connection  # we hold the only write end; it closes when we die, whatever kills us
    started_at: float = field(default_factory=time.monotonic)
    ready: bool = False
    ready_lost: bool = False  # its ready pipe closed without a record: it is dying
    stopping: bool = False  # we asked it to stop: its exit is expected
    kill_reason: str | None = None  # why we SIGKILLed it, for the line that reports its exit
    replaces: int | None = None  # rolling restart: the index of the API server it takes over from

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    @property
    def awaiting_ready(self) -> bool:
        return not self.ready and not self.ready_lost

    def signal(self, signum: int) -> None:
        if self.alive and self.process.pid:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.stopping = True
        self.signal(signal.SIGTERM)

    def kill(self, reason: str) -> None:
        """SIGKILL, once: the reason is what the log says when its exit is reported."""
        if self.kill_reason is None:
            self.kill_reason = reason
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        for conn in (self.ready_conn, self.lifeline):
            try:
                conn.close()
            except OSError:
                pass


def _spawn(mp_context: SpawnContext, name: str, kind: str, index: int, entry: str, make_launch) -> Child:
    """make_launch(ready, lifeline) -> the entry point's one argument (an ipc.launch record)."""
    ready_read, ready_write = mp_context.Pipe(duplex=False)
    lifeline_read, lifeline_write = mp_context.Pipe(duplex=False)
    launch = make_launch(ready_write, lifeline_read)
    process = mp_context.Process(target=run_child, args=(entry, launch), name=name, daemon=False)
    process.start()
    # The child has its own copies now; ours would keep the pipes open after the child died.
    ready_write.close()
    lifeline_read.close()
    log.info("started %s (pid %d)", name, process.pid)
    return Child(name, kind, index, process, ready_read, lifeline_write)


def spawn_engine_core(mp_context: SpawnContext, config: ServeConfig, rank: int, address: str,
                      curve: CurveKeys | None) -> Child:
    return _spawn(
        mp_context, f"EngineCore_DP{rank}", "engine", rank, ENGINE_ENTRY,
        lambda ready, lifeline: EngineLaunch(config, rank, ready, lifeline, address, curve),
    )


def spawn_api_server(
    mp_context: SpawnContext,
    config: ServeConfig,
    index: int,
    listen_socket: socket.socket,
    model: ModelInfo,
    engines: dict[int, str],
    shared_state: MemoryHandle,
    curve: CurveKeys | None,
) -> Child:
    """`engines`: rank -> address of every engine the server reaches."""
    ranks = tuple(sorted(engines))
    return _spawn(
        mp_context, f"ApiServer_{index}", "api", index, GRPC_API_SERVER_ENTRY if config.grpc else API_SERVER_ENTRY,
        lambda ready, lifeline: ApiServerLaunch(
            config, index, listen_socket, model, tuple(engines[r] for r in ranks), shared_state, ready,
            lifeline, ranks, curve,
        ),
    )
