"""Start our own `supervise` for a benchmark, on a free loopback port, with tests/supervise_process.py.

Where no `supervise` console script sits beside the Python running the bench (the GPU machine runs the
checkout from PYTHONPATH, nothing installed), a two-line wrapper around `python -m supervisor.cli` stands in.
"""
from __future__ import annotations

import os
import shlex
import stat
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests import supervise_process  # noqa: E402
from tests.supervise_process import Supervise  # noqa: E402


def _use_module_when_no_script() -> None:
    if os.path.exists(supervise_process.SUPERVISE):
        return
    wrapper = os.path.join(tempfile.mkdtemp(prefix="supervise-bin-"), "supervise")
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\ncd {shlex.quote(REPO)}\nexec {shlex.quote(sys.executable)} -m supervisor.cli \"$@\"\n")
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IEXEC)
    supervise_process.SUPERVISE = wrapper


def start_supervise(args: str | list[str], timeout: float = 600.0, grpc: bool = False) -> Supervise:
    """A serving `supervise ARGS` (a string is split as a shell would), with `--grpc` when `grpc`; stop it with
    `.stop()`. Its `url` is http://HOST:PORT, or grpc://HOST:PORT."""
    _use_module_when_no_script()
    args = shlex.split(args) if isinstance(args, str) else args
    if grpc:
        from tests.grpc_support import GrpcSupervise

        server = GrpcSupervise(*args)
    else:
        server = Supervise(*args)
    try:
        return server.wait_serving(timeout)
    except BaseException:
        server.stop()
        raise
