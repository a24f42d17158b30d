"""How a child notices that its supervisor is gone, even after SIGKILL, and exits instead of lingering
with the port or the GPU.

Two independent signals: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), and the read end of a
pipe whose only write end the supervisor holds: when the supervisor dies the pipe reads EOF.

A supervisor that is SIGKILLed cannot remove the group's runtime directory (engine sockets, metrics files), so
the children that outlive it do (each tries; the first wins).
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import threading
import time
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Set before the lifeline's SIGTERM: a stop signal seen once it is set stops at once. The parent-death signal and
# the lifeline's are both SIGTERM, and two that arrive before the handler runs are one (the kernel and Python
# each keep one pending flag per signal), so "the second signal forces" alone left some stops graceful: uvicorn
# waited for the streams, and the hard exit below cut them without a word.
_supervisor_gone = threading.Event()


def supervisor_gone() -> bool:
    """Whether the lifeline has read the supervisor's death: nobody restarts this group, so stop at once."""
    return _supervisor_gone.is_set()


def die_with_parent(lifeline: Connection | None, grace_seconds: float = 3.0, runtime_dir: str = "") -> None:
    """Arrange for this process to get SIGTERM when the supervisor dies, and to exit hard `grace_seconds` later;
    the group's `runtime_dir` is removed then."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the pipe alone must do
        pass
    if lifeline is None:
        return
    supervisor = os.getppid()

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        log.warning("the supervisor is gone: exiting")
        if runtime_dir:
            _remove_when_orphaned(runtime_dir, supervisor)
        _supervisor_gone.set()
        os.kill(os.getpid(), signal.SIGTERM)
        # SIGTERM starts a clean stop; if that stalls, do not outlive the grace period.
        threading.Timer(grace_seconds, lambda: os._exit(1)).start()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _remove_when_orphaned(runtime_dir: str, supervisor: int, wait_seconds: float = 1.0) -> None:
    """Remove the group's runtime directory once this process has been handed to another parent: the supervisor
    is then really gone. A pipe closed by a live supervisor (it gave up on this child) must leave the directory to
    the group, which may restart in place with it. The kernel closes a dying process's pipes a moment before it
    reparents its children, hence the short wait. Siblings exit too; what they hold open of the directory (mapped
    metrics files, bound sockets) stays valid after the unlink."""
    deadline = time.monotonic() + wait_seconds
    while os.getppid() == supervisor:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    shutil.rmtree(runtime_dir, ignore_errors=True)
