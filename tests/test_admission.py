"""Lock-free group-wide admission under real contention: several processes admitting at once against one
shared limit never hold more than the limit, and leave nothing counted behind."""
import multiprocessing as mp
import time

import atomicshm

from apiserver.admission import AdmissionControl
from apiserver.errors import Overloaded
from ipc.shared_state import GroupState

LIMIT = 1
WORKERS = 3


def _hammer(state_handle, slot: int, seconds: float, results) -> None:
    """Admit and release as fast as possible; while admitted, count this request in a shared `held` counter
    (offset 0 of `results`) and note every moment more than LIMIT were held at once."""
    state = GroupState.attach(state_handle)
    admission = AdmissionControl(state, slot, max_requests=LIMIT, max_tokens=None)
    view = atomicshm.AtomicView(results.buf)
    held, violations, admitted = view.cell_u64(0), view.cell_u64(8), view.cell_u64(16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            admission.admit(7)
        except Overloaded:
            continue
        if held.fetch_add(1) + 1 > LIMIT:
            violations.fetch_add(1)
        admitted.fetch_add(1)
        held.fetch_sub(1)
        admission.release(7)
    del held, violations, admitted
    view.close()
    state.close()


def test_racing_servers_never_hold_more_than_the_limit():
    from multiprocessing import shared_memory

    state = GroupState.create()
    results = shared_memory.SharedMemory(create=True, size=64)
    results.buf[:64] = bytes(64)
    try:
        context = mp.get_context("spawn")
        workers = [context.Process(target=_hammer, args=(state.handle, slot, 1.5, results)) for slot in range(WORKERS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert [w.exitcode for w in workers] == [0] * WORKERS
        counts = results.buf.cast("Q")
        violations, admitted = counts[1], counts[2]
        counts.release()
        assert violations == 0
        assert admitted > 100  # they did race: many admissions each
        assert state.admitted() == (0, 0)  # every admission and every undo was taken back out
    finally:
        state.close()
        results.close()
        results.unlink()
