"""Client processes that keep N identical requests in flight for a set time, as cheaply as a client can.

For bench/frontend.py, which measures what the server spends per request and per streamed token: the client
only has to keep the server busy without being the bottleneck, so it times nothing per token. It drains each
body into a short tail (the token count comes from the `usage` at the end) and counts SSE events. Several
processes, each with its own event loop, so one client core does not cap a server with many API servers.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_client import HttpClient  # noqa: E402

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 1024


async def _keep_in_flight(client: HttpClient, path: str, body: bytes, concurrency: int, duration: float,
                          expected_tokens: int, timeout: float) -> dict:
    """Closed loop until `duration` passes; requests in flight then are finished and counted."""
    deadline = time.monotonic() + duration
    done = Counter()
    errors = Counter()

    async def one_user() -> None:
        while time.monotonic() < deadline:
            tail = b""
            events = 0

            def sink(piece: bytes) -> None:
                nonlocal tail, events
                events += piece.count(b"data:")
                tail = (tail + piece)[-_TAIL_BYTES:]

            try:
                status = await client.post(path, body, sink, timeout)
            except (asyncio.TimeoutError, OSError) as exc:
                errors[type(exc).__name__] += 1
                await asyncio.sleep(0.05)  # a refusing server must not turn this loop into a spin
                continue
            if status != 200:
                errors[str(status)] += 1
                await asyncio.sleep(0.01)  # an overloaded server's 503s must not become a spin either
                continue
            counts = _COMPLETION_TOKENS.findall(tail)
            done["requests"] += 1
            done["tokens"] += int(counts[-1]) if counts else expected_tokens
            done["events"] += events

    started = time.perf_counter()
    await asyncio.gather(*(one_user() for _ in range(concurrency)))
    return {**done, "errors": dict(errors), "wall_s": time.perf_counter() - started}


def _client_process(pipe) -> None:
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    clients: dict[str, HttpClient] = {}  # one per server, so keep-alive connections outlive a phase
    while (job := pipe.recv()) is not None:
        url = job.pop("base_url")
        client = clients.get(url) or clients.setdefault(url, HttpClient(url))
        cpu_before = time.process_time()
        result = loop.run_until_complete(_keep_in_flight(client, **job))
        result["cpu_s"] = time.process_time() - cpu_before
        pipe.send(result)


class ClosedLoopClients:
    """`processes` client processes; `run` splits the concurrency among them and sums what they did. `worker` is
    what each process runs: this HTTP client, or another speaking the same pipe protocol (bench/grpc_clients.py)."""

    def __init__(self, processes: int, worker=_client_process):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no parent loop or threads
        self.pipes = []
        self.processes = []
        for _ in range(processes):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker, args=(child_end,), daemon=True)
            process.start()
            self.pipes.append(parent_end)
            self.processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def run(self, base_url: str, path: str, body: bytes, concurrency: int, duration: float,
            expected_tokens: int = 1, timeout: float = 300.0) -> dict:
        shares = [concurrency // len(self.pipes) + (i < concurrency % len(self.pipes)) for i in range(len(self.pipes))]
        busy = [(pipe, share) for pipe, share in zip(self.pipes, shares) if share > 0]
        for pipe, share in busy:
            pipe.send({"base_url": base_url, "path": path, "body": body,
                       "concurrency": share, "duration": duration, "expected_tokens": expected_tokens,
                       "timeout": timeout})
        results = [pipe.recv() for pipe, _ in busy]
        errors = Counter()
        for r in results:
            errors.update(r["errors"])
        return {
            "requests": sum(r.get("requests", 0) for r in results),
            "tokens": sum(r.get("tokens", 0) for r in results),
            "events": sum(r.get("events", 0) for r in results),
            "errors": dict(errors),
            "client_cpu_s": sum(r["cpu_s"] for r in results),
        }

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
