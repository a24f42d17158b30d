"""CPU seconds and RSS of a server's processes, read from the kernel's own accounting (/proc/PID/stat via psutil).

A process's CPU time is what it cost, whoever else shares the machine: on a crowded 2-core box the wall clock
of a benchmark moves with the neighbours, its CPU seconds per request much less.
"""
from __future__ import annotations

import os

import psutil

TITLE_PREFIX = "supervise: "


def titled_children(root_pid: int) -> dict[str, psutil.Process]:
    """`supervise: <Title>` children of our supervisor, by title (ApiServer_0, EngineCore_DP0, ...)."""
    found = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()).strip()
        except psutil.Error:
            continue
        if title.startswith(TITLE_PREFIX):
            found[title[len(TITLE_PREFIX):]] = child
    return dict(sorted(found.items()))


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    seconds = {}
    for name, process in processes.items():
        try:
            times = process.cpu_times()
            seconds[name] = times.user + times.system
        except psutil.Error:  # gone (restarted): it counts nothing from here on
            seconds[name] = 0.0
    return seconds


def cpu_ns(pid: int) -> int:
    """The CPU time the kernel counted for all the process's threads, in ns (/proc/PID/task/*/schedstat): finer than
    cpu_seconds' clock ticks, for short rounds side by side (bench/paced_pair.py)."""
    task_dir = f"/proc/{pid}/task"
    return sum(int(open(f"{task_dir}/{tid}/schedstat").read().split()[0]) for tid in os.listdir(task_dir))


def rss_mb(processes: dict[str, psutil.Process]) -> dict[str, float]:
    sizes = {}
    for name, process in processes.items():
        try:
            sizes[name] = process.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return sizes


def torch_loaded(processes: dict[str, psutil.Process]) -> dict[str, bool]:
    """Whether each process has torch's native library mapped: an API server must not (issue 15: a CUDA torch
    pulled in by a library made an idle one hold 585 MB)."""
    loaded = {}
    for name, process in processes.items():
        try:
            with open(f"/proc/{process.pid}/maps") as maps:
                loaded[name] = any("libtorch" in line for line in maps)
        except OSError:  # gone, or not Linux
            pass
    return loaded


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
