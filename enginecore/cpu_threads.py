"""How many threads torch runs on the CPU: the cores nobody else is using, re-checked as the engine works.

An OpenMP parallel region ends when its slowest thread does. With as many threads as cores and another
process busy on one of them, every region waits for whichever of our threads the kernel has descheduled, a
scheduler time slice at a time: on a 2-core box a decode step ran up to 7x slower beside one busy process,
while one thread on the free core would have lost nothing. So by default (`auto`) the engine counts what the
other processes of the machine use (all CPU time in /proc/stat less this process's own) over the last
quarter second of work, and runs on the cores left: cores - round(others), at least one. An idle machine gets
every core; an API server's few percent do not cost a thread; a busy neighbour on one core of two leaves us
one thread on the other. `OMP_NUM_THREADS` fixes the number instead (bench/contention.py measures both).

Changing the count is cheap (torch.set_num_threads between steps); it is done only when the count changes.
"""
from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

INTERVAL_S = 0.25  # how often the other processes' load is re-read while the engine works
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _machine_busy_s() -> float | None:
    """CPU seconds all processes have been busy since boot (every core), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICKS_PER_S


def _own_busy_s() -> float:
    times = os.times()
    return times.user + times.system


class CpuThreads:
    """Adapts torch's thread count to the cores others leave free; `fixed` pins it (OMP_NUM_THREADS)."""

    def __init__(self, cores: int | None = None, fixed: int | None = None):
        self.cores = cores or usable_cores()
        self.fixed = fixed
        self.threads = fixed or self.cores
        torch.set_num_threads(self.threads)
        self._mark = self._sample()

    @classmethod
    def from_environment(cls) -> "CpuThreads":
        value = os.environ.get("OMP_NUM_THREADS", "").strip()
        fixed = int(value) if value.isdigit() and int(value) > 0 else None
        return cls(fixed=fixed)

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self.cores > 1 and self._mark[1] is not None

    def _sample(self) -> tuple[float, float | None, float]:
        return time.monotonic(), _machine_busy_s(), _own_busy_s()

    def before_step(self) -> None:
        """Called before each forward pass: re-reads the load every INTERVAL_S of work (one clock read otherwise)."""
        if not self.adaptive:
            return
        now = time.monotonic()
        if now - self._mark[0] < INTERVAL_S:
            return
        if now - self._mark[0] > 4 * INTERVAL_S:  # the engine was idle: that stretch says nothing about now
            self._mark = self._sample()
            return
        sample = self._sample()
        others = ((sample[1] - self._mark[1]) - (sample[2] - self._mark[2])) / (sample[0] - self._mark[0])
        self._mark = sample
        self.set(self.threads_for(others))

    def threads_for(self, others_busy_cores: float) -> int:
        return max(1, min(self.cores, self.cores - int(others_busy_cores + 0.5)))

    def set(self, threads: int) -> None:
        if threads != self.threads:
            log.debug("CPU threads %d -> %d", self.threads, threads)
            self.threads = threads
            torch.set_num_threads(threads)
