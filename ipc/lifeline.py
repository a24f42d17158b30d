"""How a child notices that its supervisor is gone, even after SIGKILL, and exits instead of lingering
with the port or the GPU.

Two independent signals: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), and the read end of a
pipe whose only write end the supervisor holds: when the supervisor dies the pipe reads EOF.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(lifeline: Connection | None, grace_seconds: float = 3.0) -> None:
    """Arrange for this process to get SIGTERM when the supervisor dies, and to exit hard `grace_seconds` later."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the pipe alone must do
        pass
    if lifeline is None:
        return

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        log.warning("the supervisor is gone: exiting")
        os.kill(os.getpid(), signal.SIGTERM)
        # SIGTERM starts a clean stop; if that stalls, do not outlive the grace period.
        threading.Timer(grace_seconds, lambda: os._exit(1)).start()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
