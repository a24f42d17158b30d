"""`supervise` from parsed config to exit code: socket first, then the group, then the watchdog."""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from typing import Literal

from setproctitle import setproctitle

from ipc.config import ServeConfig
from ipc.curve import KeyProblem, load_keys, warn_if_unauthenticated
from ipc.logs import setup_logging
from ipc.tls import keep_files
from supervisor.events import EventSource, Timers
from supervisor.grpc_mode import reserve_port
from supervisor.group import ProcessGroup
from supervisor.layout import layout_of
from supervisor.open_files import raise_open_files_limit
from supervisor.registration import Registry
from supervisor.restart_policy import RestartBudget
from supervisor.listen_socket import BadAddress, BadSocketActivation, PortInUse, bound_address, open_listen_socket
from supervisor.signals import SignalInbox
from supervisor.startup import StartupFailed, StopRequested
from supervisor.systemd import SystemdNotifier
from supervisor.watchdog import Outcome, Watchdog

log = logging.getLogger("supervisor")


def serve(config: ServeConfig) -> int:
    setproctitle("supervise: supervisor")
    setup_logging("supervisor", config.log_level)
    raise_open_files_limit()  # before any child: they inherit it
    notifier = SystemdNotifier()
    layout = layout_of(config)
    try:
        curve = load_keys(config.data_parallel_key_file)
    except KeyProblem as exc:
        print(f"supervise: error: {exc}", file=sys.stderr)
        return 2
    metrics_socket = None
    try:
        # --grpc: grpcio binds its own sockets, so the ports are only reserved (supervisor/grpc_mode.py).
        listen_socket = (reserve_port if config.grpc else open_listen_socket)(config.host, config.port)
        if config.metrics_port is not None:
            metrics_socket = reserve_port(config.host, config.metrics_port)
            config = config.replace(metrics_port=bound_address(metrics_socket)[1])
    except PortInUse as exc:
        print(f"supervise: error: {exc}", file=sys.stderr)
        return 1
    except (BadAddress, BadSocketActivation) as exc:  # the command line's or the environment's mistake
        print(f"supervise: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"supervise: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    host, port = bound_address(listen_socket)
    registry = None
    if layout.remote_ranks:  # a head: headless nodes register the other ranks here
        try:
            registry = Registry(config, layout, curve)
        except OSError as exc:
            listen_socket.close()
            if metrics_socket is not None:
                metrics_socket.close()
            print(f"supervise: error: {exc}", file=sys.stderr)
            return 1
        log.info("%s; registration port %s", layout.describe(), registry.address)
        warn_if_unauthenticated(curve, f"registration port {registry.address}")
    inbox = SignalInbox()  # before any child exists, so a SIGTERM during the model load is heard
    runtime_dir = tempfile.mkdtemp(prefix="supervise-")
    config = config.replace(runtime_dir=runtime_dir, port=port)
    # It outlives each group restarted in place (--on-engine-failure restart), to count them.
    group_restarts = RestartBudget(config.max_engine_restarts, config.engine_restart_window)
    try:
        problem = keep_files(config)  # the copy of the TLS files that the API servers read (ipc/tls.py)
        if problem is not None:
            print(f"supervise: error: {problem}", file=sys.stderr)
            return 2
        while True:
            outcome = _run_group_once(config, listen_socket, inbox, notifier, host, port, registry, curve,
                                      group_restarts)
            if outcome is not Outcome.RESTART_GROUP:
                return outcome
            log.warning("restarting the group in place; the port stays open")
    finally:
        listen_socket.close()
        if registry is not None:
            registry.close()
        if metrics_socket is not None:
            metrics_socket.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run_group_once(config, listen_socket, inbox, notifier, host, port, registry, curve,
                    group_restarts: RestartBudget) -> int | Literal[Outcome.RESTART_GROUP]:
    timers = Timers()
    events = EventSource(inbox, timers)
    if registry is not None:
        events.links.append(registry)
    group = ProcessGroup(config, listen_socket, events, notifier, registry=registry, curve=curve)
    try:
        try:
            group.start()
        except StartupFailed as exc:
            if exc.exit_code == 2:
                print(f"supervise: error: {exc}", file=sys.stderr)
            else:
                log.error("%s", exc)
            notifier.stopping()
            return exc.exit_code
        except StopRequested:
            log.info("stop requested while starting")
            notifier.stopping()
            group.kill_all()
            return 0
        url_host = f"[{host}]" if ":" in host else host
        engines = len(group.layout.served_ranks)
        scheme = ("grpcs" if config.ssl_certfile else "grpc") if config.grpc else (
            "https" if config.ssl_certfile else "http")
        summary = (
            f"serving {config.model_name} on {scheme}://{url_host}:{port} with {config.api_server_count} API "
            f"server(s) and {engines} engine core(s)"
            + (f" ({group.layout.describe()})" if group.layout.remote_ranks or group.layout.external else "")
        )
        if config.metrics_port is not None:
            summary += f"; metrics on http://{url_host}:{config.metrics_port}/metrics"
        log.info("%s", summary)
        notifier.ready(summary)
        outcome = Watchdog(group, timers, notifier, group_restarts).run(events)
        if outcome is Outcome.RESTART_GROUP:
            # The port stays open: clients wait in the backlog for the new group. A SIGTERM meanwhile is the
            # operator's stop, not a hurry: it had cut the drain short and the new group served on regardless.
            if group.stop(drain_timeout=2.0):
                return outcome
            log.info("stop requested during the restart: the group stays down")
            notifier.stopping()
            return 0
        notifier.stopping()
        # The group is going down: new connections must be refused at once, not queued in the backlog and reset
        # when the last process holding the socket exits. Each API server closes its own copy as it drains.
        listen_socket.close()
        if outcome is Outcome.STOP:
            graceful = group.stop(config.shutdown_timeout)
            log.info("stopped%s", "" if graceful else " (cut short by a second signal)")
            return 0
        group.stop(drain_timeout=5.0)
        return 1
    finally:
        group.kill_all()
        group.close()
