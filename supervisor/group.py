"""The process group: engine cores first, then the API servers that talk to them, and the stop in reverse."""
from __future__ import annotations

import logging
import multiprocessing
import socket
import time
from multiprocessing.connection import wait

from ipc.config import ServeConfig
from ipc.model_info import EngineReady, ModelInfo
from ipc.shared_state import GroupState
from ipc.sockets import engine_address
from supervisor.children import Child, spawn_api_server, spawn_engine_core
from supervisor.signals import STOP_SIGNALS, SignalInbox
from supervisor.startup import wait_until_ready
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT = 15.0


class ProcessGroup:
    def __init__(self, config: ServeConfig, listen_socket: socket.socket, inbox: SignalInbox,
                 notifier: SystemdNotifier):
        self.config = config
        self.listen_socket = listen_socket
        self.inbox = inbox
        self.notifier = notifier
        self.ctx = multiprocessing.get_context("spawn")
        self.state = GroupState.create()
        self.lock = self.ctx.Lock()  # guards the group-wide admission counters in `state`
        self.engine_addresses = [engine_address(config.runtime_dir, r) for r in range(config.data_parallel_size)]
        self.engines: list[Child] = []
        self.api_servers: dict[int, Child] = {}
        self.draining: list[Child] = []  # replaced or surplus API servers finishing their requests
        self.model: ModelInfo | None = None

    def children(self) -> list[Child]:
        return [*self.engines, *self.api_servers.values(), *self.draining]

    def start(self) -> None:
        """Engines, then API servers; returns when all serve. Raises StartupFailed or StopRequested."""
        n = self.config.data_parallel_size
        self.notifier.status(f"loading the model in {n} engine core(s)")
        self.engines = [spawn_engine_core(self.ctx, self.config, rank) for rank in range(n)]
        records = wait_until_ready(
            self.engines, self.config.engine_ready_timeout, self.inbox, self.notifier, f"{n} engine core(s)"
        )
        ready: EngineReady = records[self.engines[0].name]
        self.model = ready.model
        log.info(
            "model %s on %s (%s), max_model_len %d, %d KV blocks of %d tokens",
            self.config.model_name, ready.model.device, ready.model.dtype, ready.model.max_model_len,
            ready.model.num_kv_blocks, ready.model.block_size,
        )
        self.notifier.status("starting the API servers")
        servers = [self.spawn_api_server(i) for i in range(self.config.api_server_count)]
        wait_until_ready(
            servers, self.config.api_server_ready_timeout, self.inbox, self.notifier,
            f"{len(servers)} API server(s)",
        )

    def spawn_api_server(self, index: int) -> Child:
        child = spawn_api_server(
            self.ctx, self.config, index, self.listen_socket, self.model, self.engine_addresses,
            self.state.name, self.lock,
        )
        self.api_servers[index] = child
        return child

    def free_api_index(self) -> int:
        taken = set(self.api_servers) | {c.index for c in self.draining}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def stop(self, drain_timeout: float) -> bool:
        """API servers drain first (up to drain_timeout), then the engines stop.
        Returns False if a second stop signal cut the drain short (everything is killed then)."""
        graceful = True
        self.state.mark_group_stopping()  # before the SIGTERMs: the servers read it when their drain starts
        servers = [c for c in self.api_servers.values() if c.alive] + [c for c in self.draining if c.alive]
        for child in servers:
            child.stop()
        if not self._wait_exit(servers, drain_timeout + 5.0):
            graceful = False
        engines = [c for c in self.engines if c.alive]
        for child in engines:
            child.stop()
        if graceful and not self._wait_exit(engines, ENGINE_STOP_TIMEOUT):
            graceful = False
        self.kill_all()
        return graceful

    def _wait_exit(self, children: list[Child], timeout: float) -> bool:
        """Wait for children to exit. False when a second SIGTERM/SIGINT says: stop now."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [c for c in children if c.alive]
            remaining = deadline - time.monotonic()
            if not alive:
                return True
            if remaining <= 0:
                for c in alive:
                    log.warning("%s did not stop within %.0f s: killing it", c.name, timeout)
                return True
            for ready in wait([c.process.sentinel for c in alive] + [self.inbox], timeout=remaining):
                if ready is self.inbox and any(s in STOP_SIGNALS for s in self.inbox.take()):
                    log.warning("second stop signal: stopping at once")
                    return False

    def kill_all(self) -> None:
        for child in self.children():
            if child.alive:
                child.kill()
        for child in self.children():
            child.process.join(5)
            child.close()

    def close(self) -> None:
        self.state.close()
