"""The engine's Triton kernels (enginecore.paged_triton, enginecore.rope_triton) compile for the GPUs the engine
serves on, checked here without one: every launch they make, for three models' heads, through Triton's compiler and ptxas for Hopper (sm_90) and
Ampere (sm_80), within the shared memory of a block there, without spilling registers, and loading K and V in
vectorized asynchronous copies
(tests/paged_triton_build.py, in a process of its own: this session runs Triton's interpreter, which checks what
the kernels compute but not that they compile)."""
import json
import os
import subprocess
import sys

import pytest

from tests.triton_setup import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="no Triton (the test extra installs it)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The most shared memory one block may use (opted in): H100/H200 227 KB, A100 163 KB.
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}


def test_every_launch_compiles_for_hopper_and_ampere_without_spilling(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not taken from an earlier run's cache
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "paged_triton_build.py")], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 3 * 6 * 2  # shapes x (three decode tiles, the split merge, a prompt chunk, RoPE) x GPUs
    failed = [row for row in rows if "error" in row]
    assert not failed, failed[0]
    for row in rows:
        assert row["shared"] <= SHARED_LIMIT[row["arch"]], row
        assert row["spilled"] == 0, row
        if row["kernel"] not in ("split merge", "rope + cache write"):  # K and V come in vectorized asynchronous copies, pipelined (16 bytes,
            # or 8 where a tile's layout splits rows finer: the 128-key tile on 64-wide heads)
            assert 16 in row["async_copy_bytes"] and min(row["async_copy_bytes"]) >= 8, row
