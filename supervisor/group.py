"""The process group: the owner of every child, as gunicorn's arbiter owns its workers.

Only the group spawns, drains, kills and reaps children, and only it edits its lists and the shared slots. The
watchdog decides *when* (it maps events to these verbs); the group does it, and never waits except in `start`
and `stop`, through the supervisor's one event source.

Start-up: engines first (the local ones, then the remote ranks headless nodes register), then the API servers
that talk to them; the stop in reverse.
"""
from __future__ import annotations

import logging
import multiprocessing
import socket
from collections.abc import Collection

import psutil

from ipc.config import ServeConfig
from ipc.curve import CurveKeys
from ipc.model_info import EngineReady, ModelInfo
from ipc.shared_state import RANK_EXITED, GroupState
from ipc.sockets import api_server_identity
from supervisor.children import Child, spawn_api_server, spawn_engine_core
from supervisor.engine_link import EngineLink
from supervisor.events import ChildExited, EventSource, SignalArrived, TimerFired
from supervisor.heartbeats import silent_servers
from supervisor.layout import layout_of, local_engine_address
from supervisor.signals import STOP_SIGNALS
from supervisor.startup import wait_until_ready
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT = 15.0
_STOP_DEADLINE = "stop-deadline"
_STOP_BEATS = "stop-beats"
STOP_BEATS_EVERY = 1.0  # seconds between looks at the draining servers' heartbeats during the stop


class ProcessGroup:
    def __init__(self, config: ServeConfig, listen_socket: socket.socket | None, events: EventSource,
                 notifier: SystemdNotifier, registry=None, curve: CurveKeys | None = None, engine_host: str = ""):
        """`registry`: a head's supervisor.registration.Registry; `curve`: the deployment's key;
        `engine_host`: where a headless node's engines listen. A headless node has no listen socket."""
        self.config = config
        self.listen_socket = listen_socket
        self.events = events
        self.notifier = notifier
        self.mp_context = multiprocessing.get_context("spawn")
        self.state = GroupState.create()
        self.layout = layout_of(config)
        self.registry = registry
        self.curve = curve
        # Rank -> address: local engines' now (a `*` port becomes real at READY), remote ones as they register.
        self.engine_addresses = {r: local_engine_address(config, self.layout, r, engine_host)
                                 for r in self.layout.local_ranks}
        self.engines: list[Child] = []
        self.api_servers: dict[int, Child] = {}  # index -> the server that serves under it
        self.draining: list[Child] = []  # replaced or surplus API servers finishing their requests
        self.model: ModelInfo | None = None
        self.engine_link: EngineLink | None = None

    def children(self) -> list[Child]:
        return [*self.engines, *self.api_servers.values(), *self.draining]

    # Start-up.
    def start(self) -> None:
        """Engines, then API servers; returns when all serve. Raises StartupFailed or StopRequested."""
        self.start_engines()
        self.notifier.status("starting the API servers")
        servers = [self.spawn_api_server(i) for i in range(self.config.api_server_count)]
        wait_until_ready(
            self.events, servers, self.config.api_server_ready_timeout, "--api-server-ready-timeout",
            self.notifier, f"{len(servers)} API server(s)",
        )

    def start_engines(self, link_identity: bytes | None = None) -> None:
        """The local engines, then the remote ranks (a head); returns once every one is ready."""
        local = self.layout.local_ranks
        self.notifier.status(f"loading the model in {len(local)} engine core(s)")
        self.engines = [
            spawn_engine_core(self.mp_context, self.config, rank, self.engine_addresses[rank], self.curve)
            for rank in local
        ]
        records = wait_until_ready(
            self.events, self.engines, self.config.engine_ready_timeout, "--engine-ready-timeout", self.notifier,
            f"{len(local)} engine core(s)",
        )
        for child in self.engines:
            self.engine_addresses[child.index] = records[child.name].address
        ready: EngineReady = records[self.engines[0].name]
        self.model = ready.model
        log.info(
            "model %s on %s (%s), max_model_len %d, %d KV blocks of %d tokens",
            self.config.model_name, ready.model.device, ready.model.dtype, ready.model.max_model_len,
            ready.model.num_kv_blocks, ready.model.block_size,
        )
        if self.layout.remote_ranks:
            self._wait_for_remote_ranks()
        extra = {} if link_identity is None else {"identity": link_identity}
        self.engine_link = self.events.engine_link = EngineLink(self.engine_addresses, self.curve, **extra)

    def _wait_for_remote_ranks(self) -> None:
        self.registry.expect_model(self.model)
        registered = self.registry.registered()
        remote = {rank: registered.get(rank) for rank in self.layout.remote_ranks}
        missing = [r for r, address in remote.items() if address is None]
        if missing:
            log.info("waiting for rank(s) %s to register at %s", ", ".join(map(str, missing)), self.registry.address)
            self.notifier.status(f"waiting for {len(missing)} rank(s) from headless nodes")
        wait_until_ready(
            self.events, [], self.config.engine_ready_timeout, "--engine-ready-timeout", self.notifier,
            f"{len(remote)} remote rank(s)", remote=remote,
        )
        self.engine_addresses.update(remote)

    # The verbs.
    def spawn_api_server(self, index: int, replaces: int | None = None) -> Child:
        assert self.listen_socket is not None and self.model is not None  # a head's, once its engines are ready
        child = spawn_api_server(
            self.mp_context, self.config, index, self.listen_socket, self.model, self.engine_addresses,
            self.state.handle, self.curve,
        )
        child.replaces = replaces
        self.api_servers[index] = child
        return child

    def replace(self, old_index: int, reserved: Collection[int] = ()) -> Child:
        """Start the successor of API server `old_index` at a free index; drain the old one once it is ready."""
        return self.spawn_api_server(self.free_api_index(reserved), replaces=old_index)

    def mark_ready(self, child: Child) -> None:
        child.ready = True

    def drain(self, index: int) -> Child:
        """API server `index` stops taking work and finishes what it has; it keeps its index until it exits."""
        child = self.api_servers.pop(index)
        child.stop()
        self.draining.append(child)
        return child

    def still_listens(self, child: Child) -> bool:
        """Whether `child` still holds a listening socket on the group's port: a drained server stops accepting
        when its event loop gets to the SIGTERM, a moment after it was sent. The kernel's view, so an HTTP server's
        copy of the shared socket and a gRPC server's own socket count alike."""
        if not child.alive or self.listen_socket is None:
            return False
        port = self.listen_socket.getsockname()[1]
        try:
            sockets = psutil.Process(child.process.pid).net_connections("tcp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        return any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets)

    def kill(self, child: Child, reason: str) -> None:
        child.kill(reason)

    def reap(self, child: Child) -> None:
        """Forget a child that exited. An API server's slot is released (its admitted requests with it) and the
        engines drop its unfinished requests."""
        if child.kind == "engine":
            self.engines.remove(child)
        elif child in self.draining:
            self.draining.remove(child)
        elif self.api_servers.get(child.index) is child:
            del self.api_servers[child.index]
        if child.kind == "api":
            self.state.release(child.index)
            if self.engine_link is not None:
                self.engine_link.abort_client(api_server_identity(child.index))
        child.close()

    def mark_engine_dead(self, rank: int, why: int = RANK_EXITED) -> None:
        """API servers fail its requests at once and send it no more, instead of waiting on an engine that will
        never reply."""
        self.state.mark_engine_dead(rank, why)

    def take_back_rank(self, rank: int, address: str) -> None:
        """A lost remote rank registered again at `address`: the supervisor's line reaches it there, and API
        servers started from now on use it (the watchdog replaces the running ones)."""
        self.engine_addresses[rank] = address
        if self.engine_link is not None:
            self.engine_link.reconnect(rank, address)
        self.state.mark_engine_live(rank)

    def mark_rank_draining(self, rank: int) -> None:
        """Rank `rank`'s node is stopping: the API servers send it no new requests (its running ones finish)."""
        self.state.mark_rank_draining(rank)

    def rank_is_down(self, rank: int) -> bool:
        return rank in self.state.down_ranks()

    # Facts the watchdog reads.
    def free_api_index(self, reserved: Collection[int] = ()) -> int:
        """The lowest index no server holds (`reserved`: indices promised to restarts that are due)."""
        taken = set(self.api_servers) | {c.index for c in self.draining} | set(reserved)
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def silent_for(self, index: int, now: float) -> float:
        """Seconds since API server `index`'s event loop last beat."""
        return now - self.state.heartbeat(index)

    # The stop.
    def stop(self, drain_timeout: float) -> bool:
        """API servers drain first (up to drain_timeout), then the engines stop.
        Returns False if a second stop signal cut the drain short (everything is killed then)."""
        self.state.mark_group_stopping()  # before the SIGTERMs: the servers read it when their drain starts
        servers = [c for c in self.api_servers.values() if c.alive] + [c for c in self.draining if c.alive]
        for child in servers:
            child.stop()
        graceful = self._wait_exit(servers, drain_timeout + 5.0)
        engines = [c for c in self.engines if c.alive]
        for child in engines:
            child.stop()
        if graceful and not self._wait_exit(engines, ENGINE_STOP_TIMEOUT):
            graceful = False
        self.kill_all()
        return graceful

    def _wait_exit(self, children: list[Child], timeout: float) -> bool:
        """Wait for children to exit, at most `timeout` s (then they are killed). False when a second
        SIGTERM/SIGINT says: stop now."""
        waiting = {c for c in children if c.alive}
        self.events.timers.set(_STOP_DEADLINE, timeout)
        self.events.timers.set(_STOP_BEATS, STOP_BEATS_EVERY)
        try:
            while waiting:
                for event in self.events.wait(waiting):
                    if isinstance(event, ChildExited):
                        waiting.discard(event.child)
                    elif isinstance(event, SignalArrived) and event.signum in STOP_SIGNALS:
                        log.warning("stop signal while the group stops: stopping at once")
                        return False
                    elif isinstance(event, TimerFired) and event.key == _STOP_DEADLINE:
                        for child in waiting:
                            log.warning("%s did not stop within %.0f s: killing it", child.name, timeout)
                            child.kill(f"it did not stop within {timeout:.0f} s")
                        return True
                    elif isinstance(event, TimerFired) and event.key == _STOP_BEATS:
                        self._kill_silent_servers(waiting)
                        self.events.timers.set(_STOP_BEATS, STOP_BEATS_EVERY)
            return True
        finally:
            self.events.timers.cancel(_STOP_DEADLINE)
            self.events.timers.cancel(_STOP_BEATS)

    def _kill_silent_servers(self, children: set[Child]) -> None:
        """API servers whose event loop fell silent while they drain for the stop (SIGSTOPped, wedged) are killed
        at --heartbeat-timeout, as the watchdog would: the stop waited --shutdown-timeout + 5 s for them, while
        new connections to the port hung."""
        now = self.events.timers.clock()
        for child, silent in silent_servers(children, self.silent_for, now, self.config.heartbeat_timeout):
            log.error("%s has not beaten for %.1f s while the group stops: killing it", child.name, silent)
            child.kill(f"its event loop was silent for {silent:.1f} s (--heartbeat-timeout)")

    def kill_all(self) -> None:
        for child in self.children():
            if child.alive:
                child.kill("the group is going down")
        for child in self.children():
            child.process.join(5)
            child.close()

    def close(self) -> None:
        if self.engine_link is not None:
            self.engine_link.close()
            self.engine_link = self.events.engine_link = None
        self.state.close()
