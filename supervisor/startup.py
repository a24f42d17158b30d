"""Waiting for children to say READY: with progress in the log, a deadline, and an ear for signals."""
from __future__ import annotations

import logging
import time
from typing import Any

from ipc.model_info import EngineFailed
from supervisor.children import Child
from supervisor.events import ChildExited, ChildReady, EventSource, RankJoined, RankLost, SignalArrived, TimerFired
from supervisor.signals import STOP_SIGNALS, describe_exit
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

PROGRESS_EVERY = 15.0
_DEADLINE = "startup-deadline"
_PROGRESS = "startup-progress"


class StartupFailed(Exception):
    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived while the group was still starting."""


def wait_until_ready(
    events: EventSource, children: list[Child], timeout: float, timeout_option: str, notifier: SystemdNotifier,
    what: str, remote: dict[int, str | None] | None = None,
) -> dict[str, Any]:
    """Each child's READY record, by child name. Raises StartupFailed (naming `timeout_option` when the time is
    up) or StopRequested. `remote`: rank -> engine address (None until registered) of the ranks headless nodes
    register, filled in as they do; waited for with the same deadline (their nodes load the model too)."""
    started = time.monotonic()
    pending: dict[str, Child | None] = {c.name: c for c in children}  # None: a remote rank's engine
    remote = {} if remote is None else remote
    pending.update({_remote_name(r): None for r, address in remote.items() if address is None})
    records: dict[str, object] = {}
    events.timers.set(_DEADLINE, timeout)
    events.timers.set(_PROGRESS, PROGRESS_EVERY)
    notifier.extend_timeout(PROGRESS_EVERY * 3)  # while the model loads: progress, not a hang
    try:
        while pending:
            for event in events.wait([c for c in pending.values() if c is not None]):
                if not pending and isinstance(event, TimerFired):
                    # All ready, within the batch of events that held a timer too (a supervisor paused or short of
                    # CPU sees the deadline and the last "ready" at once): it came too late to count.
                    continue
                if isinstance(event, ChildReady) and event.child.name in pending:
                    if isinstance(event.record, EngineFailed):
                        raise StartupFailed(event.record.message, exit_code=2 if event.record.user_error else 1)
                    event.child.ready = True
                    records[event.child.name] = event.record
                    del pending[event.child.name]
                elif isinstance(event, RankJoined) and event.rank in remote:
                    remote[event.rank] = event.address
                    pending.pop(_remote_name(event.rank), None)
                elif isinstance(event, RankLost) and event.rank in remote:
                    log.warning("rank %d is gone again while starting (%s): waiting for it", event.rank, event.reason)
                    remote[event.rank] = None
                    pending[_remote_name(event.rank)] = None
                elif isinstance(event, ChildExited) and event.child.name in pending:
                    child = event.child
                    raise StartupFailed(f"{child.name} died while starting: {describe_exit(child.process.exitcode)}")
                elif isinstance(event, SignalArrived) and event.signum in STOP_SIGNALS:
                    raise StopRequested()
                elif isinstance(event, TimerFired) and event.key == _DEADLINE:
                    names = ", ".join(pending)
                    hint = ""
                    if any(pending[name] is None for name in pending):
                        hint = ": start their nodes with `supervise --headless` and the same --data-parallel-* options"
                    raise StartupFailed(f"{names} not ready after {timeout:g} s ({timeout_option}){hint}")
                elif isinstance(event, TimerFired) and event.key == _PROGRESS:
                    log.info("still waiting for %s to be ready (%.0f s)", ", ".join(pending), time.monotonic() - started)
                    notifier.extend_timeout(PROGRESS_EVERY * 3)
                    events.timers.set(_PROGRESS, PROGRESS_EVERY)
    finally:
        events.timers.cancel(_DEADLINE)
        events.timers.cancel(_PROGRESS)
    log.info("%s ready in %.1f s", what, time.monotonic() - started)
    return records


def _remote_name(rank: int) -> str:
    return f"rank {rank} (headless)"
