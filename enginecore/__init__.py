"""The engine core: model, KV cache, scheduler and sampler in one process per data-parallel rank.

OpenMP waits: a brief spin, then sleep (set here, before torch loads libgomp; an operator's OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins). Why, with the measurements, and how the thread count follows a busy neighbour:
enginecore/cpu_threads.py.
"""
import os

SPIN_ROUNDS = "2000"  # spin rounds of a waiting OpenMP thread before it sleeps (libgomp's default: 300,000)

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS
