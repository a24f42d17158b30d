"""The engine's CPU thread count: every core on an idle machine, the cores a busy neighbour leaves free beside
one, and exactly OMP_NUM_THREADS when the operator sets it."""
import subprocess
import sys
import time

import enginecore  # noqa: F401  (first: OpenMP settings before torch loads)
import pytest
import torch
from enginecore.cpu_threads import CpuThreads, usable_cores


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_are_the_cores_others_leave_free():
    two = CpuThreads(cores=2)
    assert [two.threads_for(others) for others in (0.0, 0.3, 0.6, 1.0, 1.8, 6.0)] == [2, 2, 1, 1, 1, 1]
    eight = CpuThreads(cores=8)
    assert [eight.threads_for(others) for others in (0.2, 1.0, 2.6, 7.5)] == [8, 7, 5, 1]


def _work_beside_a_hog(threads: CpuThreads, seconds: float = 1.2) -> set[int]:
    """Run small products as engine steps would, calling before_step, while a process spins; the counts seen."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    seen = set()
    try:
        x, w = torch.randn(64, 256), torch.randn(256, 256) / 16
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            threads.before_step()
            seen.add(threads.threads)
            x = torch.tanh(x @ w)
    finally:
        hog.kill()
        hog.wait()
    return seen


@pytest.mark.skipif(usable_cores() < 2, reason="one core: nothing to leave to a neighbour")
def test_a_busy_neighbour_takes_a_thread_away():
    threads = CpuThreads()
    assert threads.adaptive
    _work_beside_a_hog(threads)
    # The hog alone keeps one core busy; other load on a shared machine can only take more.
    assert threads.threads <= usable_cores() - 1
    assert torch.get_num_threads() == threads.threads


@pytest.mark.skipif(usable_cores() < 2, reason="one core: nothing to leave to a neighbour")
def test_omp_num_threads_pins_the_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(usable_cores()))
    threads = CpuThreads.from_environment()
    assert not threads.adaptive
    assert _work_beside_a_hog(threads) == {usable_cores()}
