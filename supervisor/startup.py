"""Waiting for children to say READY: with progress in the log, a deadline, and an ear for signals."""
from __future__ import annotations

import logging
import time
from multiprocessing.connection import wait

from ipc.model_info import EngineFailed
from supervisor.children import Child
from supervisor.signals import STOP_SIGNALS, SignalInbox, describe_exit
from supervisor.systemd import SystemdNotifier

log = logging.getLogger(__name__)

PROGRESS_EVERY = 15.0


class StartupFailed(Exception):
    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived while the group was still starting."""


def wait_until_ready(
    children: list[Child], timeout: float, inbox: SignalInbox, notifier: SystemdNotifier, what: str
) -> dict[str, object]:
    """Each child's READY record, by child name. Raises StartupFailed or StopRequested."""
    started = time.monotonic()
    deadline = started + timeout
    pending = {c.ready_conn: c for c in children}
    records: dict[str, object] = {}
    next_progress = started + PROGRESS_EVERY
    while pending:
        now = time.monotonic()
        if now >= deadline:
            names = ", ".join(c.name for c in pending.values())
            raise StartupFailed(f"{names} not ready after {timeout:.0f} s (--engine-ready-timeout)")
        if now >= next_progress:
            names = ", ".join(c.name for c in pending.values())
            log.info("still waiting for %s to be ready (%.0f s)", names, now - started)
            next_progress = now + PROGRESS_EVERY
        # While the model loads, tell systemd we are making progress, not hanging.
        notifier.extend_timeout(PROGRESS_EVERY * 3)
        sentinels = {c.process.sentinel: c for c in pending.values()}
        waitables = [*pending, *sentinels, inbox]
        for ready in wait(waitables, timeout=min(deadline, next_progress) - now):
            if ready is inbox:
                if any(s in STOP_SIGNALS for s in inbox.take()):
                    raise StopRequested()
            elif ready in pending:
                child = pending[ready]
                try:
                    record = ready.recv()
                except (EOFError, OSError):
                    child.process.join(5)  # it closed the pipe unread: it is dying or dead
                    raise StartupFailed(f"{child.name} died while starting: {describe_exit(child.process.exitcode)}")
                if isinstance(record, EngineFailed):
                    raise StartupFailed(record.message, exit_code=2 if record.user_error else 1)
                child.ready = True
                records[child.name] = record
                del pending[ready]
            elif ready in sentinels:
                child = sentinels[ready]
                if child.ready_conn.poll():
                    continue  # its last word (READY or why not) is read above, in the next round
                child.process.join(0)
                raise StartupFailed(f"{child.name} died while starting: {describe_exit(child.process.exitcode)}")
    log.info("%s ready in %.1f s", what, time.monotonic() - started)
    return records
