"""How many threads torch runs on the CPU, and how their OpenMP waits behave.

Two settings pull against each other on a small machine (measured with bench/contention.py on a 2-core AMD EPYC,
float32, decode tok/s at 1 and 8 streams, alone / beside one process spinning on a core, 2026-12-01):

| setting | alone | beside the busy core |
|---|---|---|
| 2 threads, PASSIVE waits (the old default) | 40.9, 272 | 41.1, 233 |
| 2 threads, spinning 2,000 rounds before sleeping | 56.3, 355 | 28.1, 177 |
| 2 threads, spinning 10,000 rounds | 58.3, 368 | 16.7, 116 |
| 1 thread | 46.2, 255 | 44.7, 262 |

Threads that spin a little between parallel regions catch the next one (a decode step is about 150 of them, and a
PASSIVE thread pays a futex wake-up for each), so two spinning threads are the fastest alone. Beside a busy core
they are the slowest: a spinning thread holds the core its partner or the neighbour needs. One thread is steady.
So the engine spins briefly (GOMP_SPINCOUNT=enginecore.SPIN_ROUNDS, set before torch loads libgomp) and a
`ThreadGovernor` follows the cores it can actually have: every tenth of a second it reads how much CPU this process
used and how much of the machine sat idle (/proc/stat), and runs as many threads as those two add up to, rounded
(at least one, at most the usable cores), changing only when three readings in a row agree. Alone it runs every core; beside a
neighbour that takes a core it drops to what is left, and comes back when the core is free again.

OMP_NUM_THREADS fixes the count (no governor); OMP_WAIT_POLICY or GOMP_SPINCOUNT set the waits.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_fixed_by_operator() -> bool:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return value.isdigit() and int(value) > 0


def set_cpu_threads() -> int:
    """torch's thread count for the engine; returns it. OMP_NUM_THREADS (torch already took it) is kept."""
    if threads_fixed_by_operator():
        return torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    return usable_cores()


def machine_idle_cores() -> Callable[[], float]:
    """A reader of the machine's idle time: each call returns the idle core-seconds counted so far (idle and
    iowait of /proc/stat's cpu line, in seconds times cores); differences over an interval give idle cores."""
    tick = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / tick

    return read


class ThreadGovernor:
    """Runs as many torch threads as the cores this process can have (see the module's docstring)."""

    INTERVAL = 0.1  # seconds between readings (/proc/stat counts in 10 ms ticks: a tenth of a core per tick here)
    AGREE = 3  # readings in a row that must ask for the same change

    def __init__(self, max_threads: int, idle_seconds: Callable[[], float], clock: Callable[[], float] = time.monotonic,
                 cpu_seconds: Callable[[], float] = time.process_time,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads
        self.threads = max_threads
        self._idle, self._clock, self._cpu, self._set = idle_seconds, clock, cpu_seconds, set_threads
        self._last = (clock(), cpu_seconds(), idle_seconds())
        self._wanted: list[int] = []

    @classmethod
    def for_this_machine(cls) -> ThreadGovernor | None:
        """None where the count is the operator's or /proc/stat cannot be read (then every core runs)."""
        if threads_fixed_by_operator():
            return None
        try:
            return cls(usable_cores(), machine_idle_cores())
        except (OSError, ValueError, IndexError):
            return None

    def tick(self) -> None:
        """Call often (every engine step): it reads the machine only once per INTERVAL."""
        now = self._clock()
        if now - self._last[0] < self.INTERVAL:
            return
        cpu, idle = self._cpu(), self._idle()
        elapsed = now - self._last[0]
        own, free = (cpu - self._last[1]) / elapsed, (idle - self._last[2]) / elapsed
        self._last = (now, cpu, idle)
        # Rounded: beside API servers that take a few tenths of a core every core still pays; beside a neighbour
        # that takes a whole one, a thread fewer does.
        wanted = max(1, min(self.max_threads, round(own + free)))
        self._wanted = (self._wanted + [wanted])[-self.AGREE:]
        if wanted != self.threads and self._wanted == [wanted] * self.AGREE:
            log.info("CPU threads %d -> %d: this engine used %.2f cores and %.2f sat idle", self.threads, wanted,
                     own, free)
            self.threads = wanted
            self._set(wanted)
