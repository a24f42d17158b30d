"""The supervisor's one loop: child sentinels, ready pipes of new servers, signals and a 1 s timer.

It restarts what can be restarted (API servers), and decides when the group must go down (an engine core
died, or API servers keep dying). It returns what should happen next; the caller does the stopping.
"""
from __future__ import annotations

import enum
import logging
import signal
import time
from collections import deque
from multiprocessing.connection import wait

from supervisor.children import Child
from supervisor.group import ProcessGroup
from supervisor.restart_policy import RestartBudget
from supervisor.signals import STOP_SIGNALS, SignalInbox, describe_exit
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

TICK = 1.0
# After an engine core dies, API servers keep answering (503) this long before the group goes down, so
# clients get a clear answer rather than a refused connection.
ENGINE_FAILURE_GRACE = 2.0


class Outcome(enum.Enum):
    STOP = "stop"  # SIGTERM/SIGINT: drain and exit 0
    FAIL = "fail"  # the group cannot go on: exit non-zero
    RESTART_GROUP = "restart"  # an engine died and --on-engine-failure restart


class Watchdog:
    def __init__(self, group: ProcessGroup, inbox: SignalInbox, notifier: SystemdNotifier):
        self.group = group
        self.config = group.config
        self.inbox = inbox
        self.notifier = notifier
        self.budget = RestartBudget(self.config.max_restarts, self.config.restart_window)
        self.restart_due: dict[int, float] = {}  # index -> when to start its replacement
        self.to_replace: deque[int] = deque()  # SIGHUP: indices still to roll
        self.replacing: dict[int, int] = {}  # new server index -> the old index it replaces

    def run(self) -> Outcome:
        while True:
            outcome = self._step()
            if outcome is not None:
                return outcome

    def _step(self) -> Outcome | None:
        group = self.group
        children = group.children()
        starting = {c.ready_conn: c for c in group.api_servers.values() if not c.ready and c.alive}
        waitables = [c.process.sentinel for c in children if c.alive] + list(starting) + [self.inbox]
        timeout = TICK
        if self.restart_due:
            timeout = max(0.0, min(timeout, min(self.restart_due.values()) - time.monotonic()))
        for ready in wait(waitables, timeout=timeout):
            if ready is self.inbox:
                outcome = self._on_signals(self.inbox.take())
                if outcome is not None:
                    return outcome
            elif ready in starting:
                self._on_ready(starting[ready])
        outcome = self._reap()
        if outcome is not None:
            return outcome
        self._check_heartbeats()
        self._start_due_restarts()
        self._check_start_deadlines()
        if not self.restart_due and all(c.alive for c in group.api_servers.values()):
            self.notifier.watchdog_if_due()
        return None

    # Signals.
    def _on_signals(self, signals: list[int]) -> Outcome | None:
        for signum in signals:
            if signum in STOP_SIGNALS:
                log.info("%s: stopping the group gracefully", signal.Signals(signum).name)
                return Outcome.STOP
            if signum == signal.SIGHUP:
                self._begin_rolling_restart()
            elif signum == signal.SIGTTIN:
                index = self.group.free_api_index()
                log.info("SIGTTIN: adding ApiServer_%d", index)
                self.group.spawn_api_server(index)
            elif signum == signal.SIGTTOU:
                self._remove_one_server()
        return None

    def _begin_rolling_restart(self) -> None:
        if self.to_replace or self.replacing:
            log.info("SIGHUP: a rolling restart is already under way")
            return
        log.info("SIGHUP: rolling restart of %d API server(s)", len(self.group.api_servers))
        self.notifier.reloading()
        self.to_replace.extend(sorted(self.group.api_servers))
        self._replace_next()

    def _replace_next(self) -> None:
        while self.to_replace:
            old = self.to_replace.popleft()
            if old in self.group.api_servers:
                new = self.group.free_api_index()
                self.group.spawn_api_server(new)
                self.replacing[new] = old
                return
        self.notifier.ready(self._status())
        log.info("rolling restart done")

    def _remove_one_server(self) -> None:
        if len(self.group.api_servers) <= 1:
            log.warning("SIGTTOU: keeping the last API server")
            return
        index = max(self.group.api_servers)
        log.info("SIGTTOU: draining ApiServer_%d", index)
        self._drain(index)

    def _drain(self, index: int) -> None:
        child = self.group.api_servers.pop(index)
        child.stop()
        self.group.draining.append(child)

    def _on_ready(self, child: Child) -> None:
        try:
            child.ready_conn.recv()
        except (EOFError, OSError):
            return  # died before it was ready: _reap handles it
        child.ready = True
        log.info("%s ready", child.name)
        old = self.replacing.pop(child.index, None)
        if old is not None and old in self.group.api_servers:
            self._drain(old)
            self._replace_next()

    # Deaths.
    def _reap(self) -> Outcome | None:
        group = self.group
        for child in list(group.draining):
            if not child.alive:
                group.draining.remove(child)
                group.state.release(child.index)
                child.close()
                log.info("%s drained and stopped (%s)", child.name, describe_exit(child.process.exitcode))
        for child in group.engines:
            if not child.alive and not child.stopping:
                return self._on_engine_death(child)
        for index, child in list(group.api_servers.items()):
            if child.alive:
                continue
            del group.api_servers[index]
            group.state.release(index)
            child.close()
            if self.replacing.pop(index, None) is not None:
                log.error("%s, a replacement, died (%s)", child.name, describe_exit(child.process.exitcode))
            else:
                log.error("%s died: %s", child.name, describe_exit(child.process.exitcode))
            delay = self.budget.next_delay()
            if delay is None:
                log.error(
                    "more than %d API server restarts within %.0f s: taking the group down",
                    self.config.max_restarts, self.config.restart_window,
                )
                return Outcome.FAIL
            log.info("restarting ApiServer_%d in %.2f s", index, delay)
            self.restart_due[index] = time.monotonic() + delay
        return None

    def _on_engine_death(self, child: Child) -> Outcome:
        log.error("%s died: %s", child.name, describe_exit(child.process.exitcode))
        self.group.state.mark_engine_dead(child.index)
        self.notifier.status(f"{child.name} died")
        if self.config.on_engine_failure == "restart":
            log.warning("--on-engine-failure restart: restarting the whole group, the port stays open")
            return Outcome.RESTART_GROUP
        time.sleep(ENGINE_FAILURE_GRACE)
        log.error("an engine core is gone: taking the group down")
        return Outcome.FAIL

    def _start_due_restarts(self) -> None:
        now = time.monotonic()
        for index, due in list(self.restart_due.items()):
            if now >= due:
                del self.restart_due[index]
                self.group.spawn_api_server(index)

    # Liveness.
    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for child in self.group.api_servers.values():
            if not child.ready or not child.alive:
                continue
            silent = now - self.group.state.heartbeat(child.index)
            if silent > self.config.heartbeat_timeout:
                log.error("%s has not beaten for %.1f s: killing and replacing it", child.name, silent)
                child.signal(signal.SIGKILL)  # not stop(): its death must lead to a restart

    def _check_start_deadlines(self) -> None:
        now = time.monotonic()
        for child in self.group.api_servers.values():
            if not child.ready and child.alive and now - child.started_at > self.config.api_server_ready_timeout:
                log.error("%s not ready after %.0f s: killing it", child.name, now - child.started_at)
                child.signal(signal.SIGKILL)

    def _status(self) -> str:
        return f"serving with {len(self.group.api_servers)} API server(s)"
