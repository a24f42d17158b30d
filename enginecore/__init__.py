"""The engine core: model, KV cache, scheduler and sampler in one process per data-parallel rank.

OpenMP waits: libgomp's default (spin a while, then sleep) is kept on purpose. Sleeping waits at once
(OMP_WAIT_POLICY=PASSIVE) made each small decode matmul 2-4x slower here (49 us against 224 us for a
1x576x1536 product; a single stream fell from 21 to 12 tokens/s), while the bounded spin still lets an idle
engine drop to no CPU within milliseconds. An operator can still set OMP_WAIT_POLICY or GOMP_SPINCOUNT.
"""
