"""Freed heap memory handed back to the kernel now and then (glibc's malloc_trim), so the engine's RSS follows
what it holds, not what it once held.

Why: a step's tensors on the CPU come from malloc, sized by the step (prompt chunks of any length, batches of any
size). glibc serves large blocks with mmap and returns them on free, but after each such free it raises its mmap
threshold (up to 32 MB) to the size freed, so the next blocks of those sizes come from the heap arenas, where freed
memory stays mapped: steps of varied sizes (what distinct prompt lengths make) grew an engine's RSS without a plateau
in sight (bench/soak.py on the embedded model: 1.1 GB over 1,500 requests, with a 256 MiB KV cache; a loop of
oneDNN products over 150 row counts, the same sizes as before, grew 2.1 GB on its second pass, and malloc_trim gave
2.4 GB of it back in 0.3 s). Fixing the threshold instead would cost every large block a fresh mmap and its page
faults, in every step.

When: as the engine goes idle, and at the latest every BUSY_TRIM_SECONDS while it works, never more often than
IDLE_TRIM_SECONDS. A trim with little to give back takes about 10 ms. Not glibc (musl, macOS): nothing is done.
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

IDLE_TRIM_SECONDS = 5.0
BUSY_TRIM_SECONDS = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrim:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._trim = _malloc_trim()
        self._clock = clock
        self._last = clock()

    def after_work(self, idle: bool) -> None:
        """Called once per unit of work; trims when the engine goes idle or has been busy for long, if due."""
        if self._trim is None:
            return
        since = self._clock() - self._last
        if since >= BUSY_TRIM_SECONDS or (idle and since >= IDLE_TRIM_SECONDS):
            self._trim(0)
            self._last = self._clock()
