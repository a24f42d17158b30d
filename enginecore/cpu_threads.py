"""How many threads torch runs on the CPU: every core this process may use, unless OMP_NUM_THREADS says.

All cores, with PASSIVE OpenMP waits (enginecore/__init__.py), measured steadier than fewer threads on a shared
2-core machine: bench/contention.py compares the settings alone and beside a busy process, in one run. Fewer
threads chosen from the load others put on the machine (tried: cores minus the cores others kept busy) lost
more beside a neighbour (2.3-2.8x) than all cores with PASSIVE waits (1.1x), because on a busy machine the
kernel shares time per thread.
"""
from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_cpu_threads() -> int:
    """torch's thread count for the engine; returns it. OMP_NUM_THREADS (torch already took it) is kept."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    return usable_cores()
