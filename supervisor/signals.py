"""Signals as events: handlers only note the signal and wake the supervisor's event source through a
self-pipe, so every decision is taken in the supervisor's loop, never inside a signal handler."""
from __future__ import annotations

import os
import signal
from collections import deque

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalInbox:
    def __init__(self) -> None:
        self._pending: deque[int] = deque()
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in HANDLED:
            signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        self._pending.append(signum)

    def fileno(self) -> int:
        """Readable when a signal arrived (the event source waits on it)."""
        return self._read_fd

    def take(self) -> list[int]:
        try:
            while os.read(self._read_fd, 512):
                pass
        except BlockingIOError:
            pass
        taken = list(self._pending)
        self._pending.clear()
        return taken


def ignore_from_now() -> None:
    """The group is down and the exit code decided: a signal now changes nothing. Python restores the default
    handlers as it exits (but leaves ignored signals ignored), and a second SIGTERM 50 ms after the first, during a
    start-up, then ended the supervisor with 143 instead of its 0 (an operator's or systemd's second stop)."""
    for signum in HANDLED:
        signal.signal(signum, signal.SIG_IGN)


def describe_exit(exitcode: int | None, kill_reason: str | None = None) -> str:
    """How a child ended, for the log line that says why. `kill_reason`: why the supervisor itself killed it."""
    if exitcode is None:
        return "still running"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    signum = -exitcode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGKILL:
        if kill_reason is not None:
            return f"killed by {name} (by the supervisor: {kill_reason})"
        return f"killed by {name} (perhaps out of memory)"
    return f"killed by {name}"
