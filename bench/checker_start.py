"""How often an API server's grammar checker fails to start while the server serves gRPC (target: never).

The checker (apiserver/grammar_checker.py) is a process of its own, started with the first grammar and again after
a grammar killed it. Until 2026-12-01 it was started by asyncio's create_subprocess_exec, which under uvloop forks
the server and runs Python's after-fork code in the copy before exec; with gRPC's poller threads at work the copy
crashed there in 3-5 starts of 300 (SIGSEGV, or SIGABRT "Check failed: next_worker->state == KICKED" in gRPC's
epoll poller) on the 2-core AMD EPYC VM, and the call failed INTERNAL.

This runs what a gRPC API server runs: a uvloop loop serving a grpc.aio server that another process calls
without pause (health checks), and in it the real GrammarChecker, started, used and killed `--starts` times.

    .venv/bin/python bench/checker_start.py [--starts 300] [--callers 3]

Run with PYTHONPATH set to another checkout to measure its code side by side.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

import grpc
import uvloop
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2_grpc

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from apiserver.grammar_checker import CheckerUnavailable, GrammarChecker  # noqa: E402

_CALLER = """
import sys, threading, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
def call():
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1]))
    while True:
        stub.Check(health_pb2.HealthCheckRequest())
for _ in range(int(sys.argv[2])):
    threading.Thread(target=call).start()
"""


async def _measure(starts: int, callers: int) -> collections.Counter:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_async.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, f"127.0.0.1:{port}", str(callers)],
                              stderr=subprocess.DEVNULL)
    outcomes: collections.Counter = collections.Counter()
    checker = GrammarChecker("supervise: GrammarChecker_bench", timeout=30)
    try:
        for i in range(starts):
            try:
                await checker.build("regex", f"[a-z]{{{i % 50 + 1}}}")  # a new grammar: nothing kept decides it
                outcomes["started"] += 1
            except CheckerUnavailable:
                outcomes["did not start"] += 1
            except Exception as exc:  # what the old code raised (ProcessLookupError, from killing a dead copy)
                outcomes[f"failed: {type(exc).__name__}"] += 1
            await checker.close()  # the next build starts it again
            if (i + 1) % 50 == 0:
                print(f"  {i + 1} starts: {dict(outcomes)}", flush=True)
    finally:
        caller.kill()
        caller.wait()
        await server.stop(0)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=300)
    parser.add_argument("--callers", type=int, default=3, help="threads of the other process calling the server")
    args = parser.parse_args()
    started = time.perf_counter()
    outcomes = uvloop.run(_measure(args.starts, args.callers))
    failed = args.starts - outcomes["started"]
    verdict = "meets" if failed == 0 else "misses"
    print(f"{failed} of {args.starts} checker starts failed in {time.perf_counter() - started:.0f} s "
          f"({verdict} the target of none): {dict(outcomes)}")


if __name__ == "__main__":
    main()
