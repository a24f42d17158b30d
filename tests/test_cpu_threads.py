"""The engine's CPU threads: every usable core with OpenMP waits that sleep (PASSIVE) by default, so a busy
neighbour or the API servers get a core back at once; OMP_NUM_THREADS and OMP_WAIT_POLICY still win."""
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
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "threads": set_cpu_threads(),
                  "torch": torch.get_num_threads(), "cores": usable_cores()}))
"""


def _probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, "PYTHONPATH": REPO, **env}, cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_default_is_every_core_with_passive_waits():
    got = _probe()
    assert got["policy"] == "PASSIVE"
    assert got["threads"] == got["torch"] == got["cores"]


def test_operator_settings_win():
    got = _probe(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="ACTIVE")
    assert got["policy"] == "ACTIVE"
    assert got["threads"] == got["torch"] == 1
