"""The watchdog: what the supervisor does about each event while the group serves.

It maps events to the group's verbs (spawn, replace, drain, kill, reap) and never blocks: waits become timers
(a restart's back-off, the grace after an engine died, the 1 s tick that checks heartbeats). It restarts what
can be restarted (API servers) and decides when the group must go down (an engine core died, or API servers
keep dying); it returns what should happen next, and the caller does the stopping.
"""
from __future__ import annotations

import enum
import logging
import signal
from collections import deque

from ipc.tls import keep_files
from supervisor.children import Child
from supervisor.engine_liveness import EngineLiveness
from supervisor.heartbeats import silent_servers
from supervisor.events import (ChildExited, ChildReady, Event, EventSource, RankDraining, RankJoined, RankLost,
                               SignalArrived, TimerFired, Timers)
from supervisor.restart_policy import RestartBudget
from supervisor.signals import STOP_SIGNALS, describe_exit
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

TICK = 1.0
# After an engine core dies, API servers keep answering (503) this long before the group goes down, so
# clients get a clear answer rather than a refused connection.
ENGINE_FAILURE_GRACE = 2.0
_TICK = "tick"
_ENGINE_GRACE = "engine-grace"
_RESTART = "restart"  # timer key (_RESTART, index): start the replacement of a dead API server
_ROLL_END = "roll-end"  # the last rolling restart's drained servers: have they stopped listening?
# A drained server stops accepting once its event loop gets to the SIGTERM (milliseconds, or a busy moment). The
# rolling restart ends (READY=1 to systemd, `systemctl reload` returns) only after, so nothing accepted later is
# served by the old configuration; a server that still listens after ROLL_END_LIMIT is left to its heartbeat.
ROLL_END_POLL = 0.05
ROLL_END_LIMIT = 10.0


class Outcome(enum.Enum):
    STOP = "stop"  # SIGTERM/SIGINT: drain and exit 0
    FAIL = "fail"  # the group cannot go on: exit non-zero
    RESTART_GROUP = "restart"  # an engine died and --on-engine-failure restart


class Watchdog:
    def __init__(self, group, timers: Timers, notifier: SystemdNotifier, group_restarts: RestartBudget | None = None):
        """`group`: a supervisor.group.ProcessGroup, or anything with its verbs (the tests use a fake).
        `group_restarts`: the group's restarts in place (--on-engine-failure restart), which outlive a watchdog."""
        self.group = group
        self.config = group.config
        self.timers = timers
        self.notifier = notifier
        self.budget = RestartBudget(self.config.max_restarts, self.config.restart_window)
        self.group_restarts = group_restarts or RestartBudget(
            self.config.max_engine_restarts, self.config.engine_restart_window)
        self.restarts_due: dict[int, int | None] = {}  # index of a dead API server -> the index it replaced
        self.to_roll: deque[int] = deque()  # SIGHUP: indices still to replace
        self.rolling = False
        self.roll_again = False  # asked for during a rolling restart (SIGHUP, a rank back): roll once more after it
        self.rolled_out: list[Child] = []  # the servers this rolling restart drained
        self.roll_end_deadline = 0.0
        self.engine_failed = False  # the group goes down when the grace ends; nothing is restarted meanwhile
        self.liveness = EngineLiveness(self.config.engine_ping_interval)
        # systemd's watchdog wants a ping every half period: tick at least that often.
        self.tick = min(TICK, notifier.watchdog_interval or TICK)
        timers.set(_TICK, self.tick)

    def run(self, events: EventSource) -> Outcome:
        while True:
            for event in events.wait(self.group.children()):
                outcome = self.handle(event)
                if outcome is not None:
                    return outcome

    def handle(self, event: Event) -> Outcome | None:
        if isinstance(event, SignalArrived):
            return self._on_signal(event.signum)
        if isinstance(event, ChildReady):
            self._on_ready(event.child)
        elif isinstance(event, ChildExited):
            return self._on_exit(event.child)
        elif isinstance(event, TimerFired):
            return self._on_timer(event.key)
        elif isinstance(event, RankLost):
            return self._on_rank_lost(event)
        elif isinstance(event, RankJoined):
            self._on_rank_joined(event)
        elif isinstance(event, RankDraining):
            self.group.mark_rank_draining(event.rank)
            self.notifier.status(f"rank {event.rank} draining (node {event.node} stops)")
        return None

    # Signals.
    def _on_signal(self, signum: int) -> Outcome | None:
        if signum in STOP_SIGNALS:
            if self.engine_failed:
                return Outcome.FAIL  # going down already, and not cleanly: an engine died
            log.info("%s: stopping the group gracefully", signal.Signals(signum).name)
            return Outcome.STOP
        if self.engine_failed:
            return None
        if signum == signal.SIGHUP:
            problem = keep_files(self.config)  # the new servers read the TLS files' new copy (a renewal)
            if problem:
                log.error("SIGHUP: no rolling restart, the API servers serve on as they are: %s", problem)
            else:
                self._begin_rolling_restart("SIGHUP")
        elif signum == signal.SIGTTIN:
            index = self.group.free_api_index(set(self.restarts_due))
            log.info("SIGTTIN: adding ApiServer_%d", index)
            self.group.spawn_api_server(index)
        elif signum == signal.SIGTTOU:
            self._remove_one_server()
        return None

    def _begin_rolling_restart(self, why: str) -> None:
        if self.rolling:
            # Servers started before `why` (a renewed certificate copied, a rank back) would keep what they read.
            log.info("%s: a rolling restart is under way; another follows it", why)
            self.roll_again = True
            return
        log.info("%s: rolling restart of %d API server(s)", why, len(self.group.api_servers))
        self.notifier.reloading()
        self.rolling = True
        self.to_roll.extend(sorted(self.group.api_servers))
        self._replace_next()

    def _replace_next(self) -> None:
        while self.to_roll:
            old = self.to_roll.popleft()
            if old in self.group.api_servers:
                self.group.replace(old, set(self.restarts_due))
                return
        self.roll_end_deadline = self.timers.clock() + ROLL_END_LIMIT
        self._end_roll_once_closed()

    def _end_roll_once_closed(self) -> None:
        listening = [c for c in self.rolled_out if self.group.still_listens(c)]
        if listening and self.timers.clock() < self.roll_end_deadline:
            self.timers.set(_ROLL_END, ROLL_END_POLL)
            return
        if listening:
            log.warning("%s still listen(s) %.0f s after their drain began: ending the rolling restart anyway",
                        ", ".join(c.name for c in listening), ROLL_END_LIMIT)
        self.rolled_out = []
        self.rolling = False
        self.notifier.ready(self._status())
        log.info("rolling restart done")
        if self.roll_again:
            self.roll_again = False
            self._begin_rolling_restart("asked for during the last one")

    def _remove_one_server(self) -> None:
        if len(self.group.api_servers) <= 1:
            log.warning("SIGTTOU: keeping the last API server")
            return
        index = max(self.group.api_servers)
        log.info("SIGTTOU: draining ApiServer_%d", index)
        self.group.drain(index)

    def _on_ready(self, child: Child) -> None:
        self.group.mark_ready(child)
        log.info("%s ready", child.name)
        if child.replaces is not None:
            if child.replaces in self.group.api_servers:
                self.rolled_out.append(self.group.drain(child.replaces))
            self._replace_next()

    # Deaths.
    def _on_exit(self, child: Child) -> Outcome | None:
        self.group.reap(child)
        how = describe_exit(child.exitcode, child.kill_reason)
        if child.kind == "engine":
            return self._on_engine_exit(child, how)
        if child.stopping:
            log.info("%s drained and stopped (%s)", child.name, how)
            return None
        if child.replaces is not None:
            log.error("%s, a replacement, died (%s)", child.name, how)
        else:
            log.error("%s died: %s", child.name, how)
        if self.engine_failed:
            return None
        delay = self.budget.next_delay(self.timers.clock())
        if delay is None:
            log.error(
                "more than %d API server restarts within %.0f s: taking the group down",
                self.config.max_restarts, self.config.restart_window,
            )
            return Outcome.FAIL
        log.info("restarting ApiServer_%d in %.2f s", child.index, delay)
        # A replacement that died is restarted as a replacement, so the rolling restart goes on when it is ready.
        self.restarts_due[child.index] = child.replaces
        self.timers.set((_RESTART, child.index), delay)
        return None

    def _on_engine_exit(self, child: Child, how: str) -> Outcome | None:
        if child.stopping:
            return None
        log.error("%s died: %s", child.name, how)
        self.group.mark_engine_dead(child.index)
        self.notifier.status(f"{child.name} died")
        if self.config.on_engine_failure == "restart":
            # Counted, not spaced: the model's load spaces the restarts already.
            if self.group_restarts.next_delay(self.timers.clock()) is not None:
                log.warning("--on-engine-failure restart: restarting the whole group, the port stays open")
                return Outcome.RESTART_GROUP
            log.error("%d group restart(s) within %.0f s already (--max-engine-restarts, --engine-restart-window): "
                      "the group goes down", self.config.max_engine_restarts, self.config.engine_restart_window)
        self._go_down_after_grace()
        return None

    def _go_down_after_grace(self) -> None:
        if not self.engine_failed:
            self.engine_failed = True
            self.timers.set(_ENGINE_GRACE, ENGINE_FAILURE_GRACE)

    # Remote ranks (a head): what the registration port saw.
    def _on_rank_lost(self, event: RankLost) -> Outcome | None:
        """A headless node's rank is gone: its requests fail at once (503, or an error event in a stream). The
        group goes down like for any engine failure, or, with --on-engine-failure restart, serves on with the
        ranks it has until the node registers again: the other ranks lose nothing. A rank whose node was being
        stopped (it drained first: `systemctl stop`, a node's upgrade) is no failure in either mode: taking the
        group down for it would fail every request on the other ranks, which the drain exists to spare."""
        self.group.mark_engine_dead(event.rank, event.why)
        self.notifier.status(f"rank {event.rank} lost")
        if self.config.on_engine_failure == "restart" or event.draining:
            live = [r for r in self.group.layout.served_ranks if not self.group.rank_is_down(r)]
            why = "its node was stopped" if event.draining else "--on-engine-failure restart"
            log.warning("%s: serving on ranks %s until rank %d registers again", why,
                        ", ".join(map(str, live)) or "(none)", event.rank)
            return None
        self._go_down_after_grace()
        return None

    def _on_rank_joined(self, event: RankJoined) -> None:
        """A rank registered while the group serves: a lost one coming back (--on-engine-failure restart), or a
        live one at a new address. New API servers connect to it; the running ones are replaced one by one, each
        finishing its requests first (the rolling restart of SIGHUP)."""
        if self.engine_failed:
            return
        self.group.take_back_rank(event.rank, event.address)
        log.info("rank %d is back (node %s, engine at %s): replacing the API servers so they reach it",
                 event.rank, event.node, event.address)
        self._begin_rolling_restart(f"rank {event.rank} is back")

    # Timers.
    def _on_timer(self, key) -> Outcome | None:
        if key == _TICK:
            self._check_heartbeats()
            self._check_start_deadlines()
            self.liveness.kill_silent(self.group.engine_link, self.group.engines)
            if not self.engine_failed and not self.restarts_due and all(c.alive for c in self.group.api_servers.values()):
                self.notifier.watchdog_if_due()
            self.timers.set(_TICK, self.tick)
        elif key == _ROLL_END:
            self._end_roll_once_closed()
        elif key == _ENGINE_GRACE:
            log.error("an engine core is gone: taking the group down")
            return Outcome.FAIL
        elif isinstance(key, tuple) and key[0] == _RESTART:
            index = key[1]
            replaces = self.restarts_due.pop(index)
            if not self.engine_failed:
                self.group.spawn_api_server(index, replaces)
        return None

    # Liveness.
    def _check_heartbeats(self) -> None:
        """A server whose event loop is silent is killed: a serving one is replaced, a draining one (a rolling
        restart's, SIGTTOU's) only killed, as its successor serves already. A draining one was left out, and one
        frozen mid-drain held its requests, its admission slots and its copy of the port for as long as it was."""
        servers = [*self.group.api_servers.values(), *self.group.draining]
        for child, silent in silent_servers(servers, self.group.silent_for, self.timers.clock(),
                                            self.config.heartbeat_timeout):
            draining = child in self.group.draining
            log.error("%s has not beaten for %.1f s%s", child.name, silent,
                      ", while it drained: killing it (its unfinished requests fail)" if draining else
                      ": killing and replacing it")
            self.group.kill(child, f"its event loop was silent for {silent:.1f} s (--heartbeat-timeout)")

    def _check_start_deadlines(self) -> None:
        now = self.timers.clock()
        limit = self.config.api_server_ready_timeout
        for child in list(self.group.api_servers.values()):
            if child.ready or not child.alive or child.kill_reason is not None:
                continue
            if now - child.started_at > limit:
                log.error("%s not ready after %.0f s: killing it", child.name, now - child.started_at)
                self.group.kill(child, f"not ready after {limit:.0f} s (--api-server-ready-timeout)")

    def _status(self) -> str:
        return f"serving with {len(self.group.api_servers)} API server(s)"
