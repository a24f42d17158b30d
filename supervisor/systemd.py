"""sd_notify without a dependency: READY=1, STATUS=, WATCHDOG=1, EXTEND_TIMEOUT_USEC=, RELOADING=1, STOPPING=1."""
from __future__ import annotations

import os
import socket
import time


class SystemdNotifier:
    def __init__(self) -> None:
        # Taken out of the environment so that children, which inherit it, never talk to systemd themselves.
        self._address = os.environ.pop("NOTIFY_SOCKET", None)
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        self.watchdog_interval = None
        if usec and (pid is None or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6 / 2  # systemd advises pinging at half the period
        self._last_watchdog = 0.0

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> None:
        if not self._address:
            return
        address = self._address
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
        except OSError:
            pass  # systemd going away must never take the group down
        finally:
            sock.close()

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> None:
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def reloading(self) -> None:
        self.notify("RELOADING=1", f"MONOTONIC_USEC={int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def watchdog_if_due(self) -> None:
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval:
            self._last_watchdog = now
            self.notify("WATCHDOG=1")
