"""The engine core: model, KV cache, scheduler and sampler in one process per data-parallel rank."""
import os

# The engine shares a few CPU cores with the API servers (and, in tests, with everything else). OpenMP threads
# that spin while they wait for each other (libgomp's default) then fight the very processes feeding them: measured
# here 3-4x slower steps under load. Sleeping waits cost little when the box is quiet. Read once, when torch loads
# libgomp, so this must run before the first `import torch` (every enginecore module imports this package first).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
