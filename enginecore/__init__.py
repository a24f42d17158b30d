"""The engine core: model, KV cache, scheduler and sampler in one process per data-parallel rank.

OpenMP waits: PASSIVE by default (set here, before torch loads libgomp; an operator's OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins). libgomp's own default spins a waiting thread for a while, which on a machine shared with
other work is ruinous: a spinning thread holds a core that its descheduled partner, the API servers or a
neighbour need, and every parallel region then waits a scheduler time slice. bench/contention.py on a 2-core
AMD EPYC shared with other sessions (load average 7-14), decode tok/s alone and beside one spinning process,
2026-11-30: 2 threads spinning 1.8 and 9.2 (1 and 8 streams) alone, 0.6 and 3.6 beside; 2 threads PASSIVE
24.5 and 111.1 alone, 21.9 and 100.9 beside (1.1x slowdown); 1 thread 21.6 and 144.3 alone, 9.6 and 51.7
beside. An earlier finding (PASSIVE halved one stream's speed, 21 against 12 tok/s) was measured with
transformers' forward, about 100 ops a layer, each a sleep and wake-up; the lean CPU forward issues about 20.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
