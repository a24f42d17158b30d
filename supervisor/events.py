"""The supervisor's one event source: every child's sentinel, the ready pipes of children that have not yet
said READY, the signal self-pipe, the sockets of the supervisor's line to the engines, those of the
data-parallel links (a head's registration port, a headless node's line to its head), and named timers, all in
one `multiprocessing.connection.wait`.

Start-up, the watchdog and the stop all take their events from here; each maps them to what it does. Deaths
are level-triggered: a dead child is reported on every wait that watches it, until its owner stops watching it
(the group reaps it), so no phase can swallow a death that the next one needs.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait

from supervisor.children import Child
from supervisor.engine_link import EngineLink
from supervisor.signals import SignalInbox


@dataclass(frozen=True)
class ChildReady:
    child: Child
    record: object  # what it sent over its ready pipe: EngineReady, EngineFailed, or True from an API server


@dataclass(frozen=True)
class ChildExited:
    child: Child


@dataclass(frozen=True)
class SignalArrived:
    signum: int


@dataclass(frozen=True)
class TimerFired:
    key: Hashable


@dataclass(frozen=True)
class RankJoined:
    """A remote rank registered (a headless node's engine, reachable at `address`)."""

    rank: int
    address: str
    node: str


@dataclass(frozen=True)
class RankLost:
    """A remote rank is gone: its node left or fell silent. `why`: an ipc.shared_state RANK_* code."""

    rank: int
    reason: str
    why: int
    draining: bool = False  # its node said it was stopping: a planned leave, not a failure


@dataclass(frozen=True)
class RankDraining:
    """A remote rank's node is stopping: the rank finishes its requests and is sent no new ones, then its node
    leaves (a RankLost)."""

    rank: int
    node: str


@dataclass(frozen=True)
class LinkEvent:
    """Something a data-parallel link has to tell its owner (the headless node's line to its head)."""

    what: str
    detail: str = ""


Event = ChildReady | ChildExited | SignalArrived | TimerFired | RankJoined | RankLost | RankDraining | LinkEvent


class Timers:
    """Named deadlines: setting a name again moves its deadline. Pure bookkeeping (no processes, no waiting), so
    the watchdog's tests drive it with their own clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._due: dict[Hashable, float] = {}

    def set(self, key: Hashable, delay: float) -> None:
        self._due[key] = self.clock() + delay

    def cancel(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def is_set(self, key: Hashable) -> bool:
        return key in self._due

    def seconds_to_next(self) -> float | None:
        if not self._due:
            return None
        return max(0.0, min(self._due.values()) - self.clock())

    def pop_due(self) -> list[Hashable]:
        """The keys whose deadline has passed, earliest first; they are forgotten."""
        now = self.clock()
        due = sorted((at, i, key) for i, (key, at) in enumerate(self._due.items()) if at <= now)
        for _, _, key in due:
            del self._due[key]
        return [key for _, _, key in due]


class EventSource:
    def __init__(self, inbox: SignalInbox, timers: Timers):
        self.inbox = inbox
        self.timers = timers
        self.engine_link: EngineLink | None = None  # once the engines serve
        # Data-parallel links: objects with filenos(), take() -> [Event], seconds_to_next() -> float | None.
        self.links: list = []

    def wait(self, children: Iterable[Child], timeout: float | None = None) -> list[Event]:
        """Block until something happens to `children`, a signal, a timer (or `timeout`); what happened."""
        children = list(children)
        sentinels = {c.process.sentinel: c for c in children}
        pipes = {c.ready_conn: c for c in children if c.awaiting_ready}
        link_fds = self.engine_link.filenos() if self.engine_link is not None else []
        for link in self.links:
            link_fds += link.filenos()
        for next_due in (self.timers.seconds_to_next(), *(link.seconds_to_next() for link in self.links)):
            if next_due is not None:
                timeout = next_due if timeout is None else min(timeout, next_due)
        # wait() takes any object with fileno(); typeshed names only connections, sockets and ints.
        woke = wait([*sentinels, *pipes, self.inbox, *link_fds], timeout=timeout)  # type: ignore[list-item]
        events: list[Event] = []
        for conn in woke:
            if conn in pipes:
                events.extend(_read_ready(pipes[conn]))
        for sentinel in woke:
            if sentinel in sentinels:
                child = sentinels[sentinel]
                if not _has_exited(child):
                    continue  # reported on a later wake: its sentinel stays readable
                if child.awaiting_ready and child.ready_conn not in woke and child.ready_conn.poll():
                    events.extend(_read_ready(child))  # its last word (READY or why not) comes first
                events.append(ChildExited(child))
        if self.inbox in woke:
            events.extend(SignalArrived(signum) for signum in self.inbox.take())
        if self.engine_link is not None:
            # ZMQ's FD is edge-triggered: drain on every wake, not only when the FD said so.
            self.engine_link.take_answers()
        for link in self.links:
            events.extend(link.take())
        events.extend(TimerFired(key) for key in self.timers.pop_due())
        return events


def _has_exited(child: Child, patience: float = 1.0) -> bool:
    """Whether a child whose sentinel closed can be reaped. The sentinel closes while the process exits; the
    kernel makes it a zombie moments later (longer with many threads to end). Waiting for that here, briefly,
    saves the loop from spinning on a readable sentinel meanwhile."""
    deadline = time.monotonic() + patience
    while child.alive:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _read_ready(child: Child) -> list[Event]:
    try:
        return [ChildReady(child, child.ready_conn.recv())]
    except (EOFError, OSError):
        child.ready_lost = True  # closed unread: it is dying, and its sentinel will say so
        return []
