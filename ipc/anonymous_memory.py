"""Shared memory without a name: a memfd, handed to child processes as a file descriptor.

A named POSIX segment (multiprocessing.shared_memory, a file in /dev/shm) outlives its processes until someone
unlinks it. multiprocessing's resource tracker unlinks it when the owner alone is killed, but the tracker is one
more process of the unit, and when every process is SIGKILLed at once (systemd's final SIGKILL of a unit, the
OOM killer of a cgroup, `kill -9` of a process group) nothing unlinks it: under systemd with restarts, one
leaked segment per such kill. The alternatives leave that case open too: a child that unlinks it when its
supervisor dies is killed with the rest; a starting
supervisor that removes segments whose owner pid is dead runs only if something starts again, and cannot tell
a dead owner from a live one in another pid namespace sharing /dev/shm (containers), whose segment it would
remove. Memory that never had a name needs no cleaning: the kernel frees it when the last process holding it
(the descriptor or a mapping) is gone, however each ended, and no other group can see it.
"""
from __future__ import annotations

import os
import tempfile
from multiprocessing import reduction
from typing import Any


class MemoryHandle:
    """A descriptor of the memory. Pickled into a child's launch record (multiprocessing `spawn`), it is
    duplicated into the child, as a Connection or a socket is; the child owns its copy."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate: Any) -> MemoryHandle:
    return MemoryHandle(duplicate.detach())


def anonymous_memory(label: str, size: int) -> MemoryHandle:
    """`size` zero bytes to map shared. `label` shows in /proc/<pid>/maps (`/memfd:<label> (deleted)`)."""
    if hasattr(os, "memfd_create"):  # Linux
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
    else:  # elsewhere a file unlinked at once is as nameless, if not always kept in memory
        fd, path = tempfile.mkstemp(prefix=f"{label}-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return MemoryHandle(fd)
