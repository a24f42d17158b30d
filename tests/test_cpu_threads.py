"""The engine's CPU threads: every usable core at start, OpenMP waits that spin briefly and then sleep
(GOMP_SPINCOUNT=enginecore.SPIN_ROUNDS) and a thread governor that follows a busy neighbour (tests/
test_thread_governor.py); OMP_NUM_THREADS (no governor then), OMP_WAIT_POLICY and GOMP_SPINCOUNT still win."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import json, os
import enginecore
import torch
from enginecore.cpu_threads import set_cpu_threads, usable_cores
from enginecore.cpu_threads import ThreadGovernor
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "threads": set_cpu_threads(), "torch": torch.get_num_threads(), "cores": usable_cores(),
                  "governed": ThreadGovernor.for_this_machine() is not None}))
"""


def _probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, "PYTHONPATH": REPO, **env}, cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_default_is_every_core_with_brief_spins_and_a_governor():
    import enginecore

    got = _probe()
    assert got["policy"] is None and got["spin"] == enginecore.SPIN_ROUNDS
    assert got["threads"] == got["torch"] == got["cores"]
    assert got["governed"]


def test_operator_settings_win():
    got = _probe(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="ACTIVE")
    assert got["policy"] == "ACTIVE" and got["spin"] is None
    assert got["threads"] == got["torch"] == 1
    assert not got["governed"]
    assert _probe(GOMP_SPINCOUNT="50")["spin"] == "50"
