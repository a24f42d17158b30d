"""Large JSON schemas against one API server: how long its event loop is held, read as the longest wait of a
/health polled every 10 ms beside them. `--clients K` chats at once, each with a `response_format` schema of
`--properties` string properties (150,000: 4.5 MB, which llguidance then refuses as too large: the build before
that verdict is what is measured). A schema of 64 KB or more is built by a grammar checker, in its own process
(apiserver/structured_outputs.py); built in the event loop, 4.5 MB held it about 0.6 s.

    .venv/bin/python bench/large_schema.py --clients 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402

TARGET_MS = 500.0  # (parsing a 4.3 MB body, which the event loop must do, takes about 0.2 s of it)


def chat_body(model: str, properties: int) -> bytes:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode()


async def measure(base_url: str, body: bytes, clients: int) -> tuple[list[int], float, float]:
    """The statuses, the seconds they took, the longest /health wait (s)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as chats, \
            httpx.AsyncClient(base_url=base_url, timeout=600) as health:
        await health.get("/health")
        longest, done = 0.0, False

        async def poll() -> None:
            nonlocal longest
            while not done:
                started = time.perf_counter()
                await health.get("/health")
                longest = max(longest, time.perf_counter() - started)
                await asyncio.sleep(0.01)

        poller = asyncio.create_task(poll())
        started = time.perf_counter()
        replies = await asyncio.gather(*[chats.post("/v1/chat/completions", content=body,
                                                    headers={"content-type": "application/json"})
                                         for _ in range(clients)])
        took = time.perf_counter() - started
        done = True
        await poller
    return [r.status_code for r in replies], took, longest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--properties", type=int, default=150_000)
    p.add_argument("--args", default="", help="more supervise options")
    args = p.parse_args()
    print(machine_info())
    server = start_supervise(f"--model sim:1 {args.args}")
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = chat_body(model, args.properties)
        asyncio.run(measure(server.url, chat_body(model, 10), 1))  # the checker's process started
        statuses, took, longest = asyncio.run(measure(server.url, body, args.clients))
        print(f"{args.clients} schemas of {len(body) / 2**20:.1f} MB at once: {took:.2f} s, statuses {statuses}; "
              f"longest /health wait {longest * 1000:.0f} ms (target <= {TARGET_MS:.0f} ms): "
              f"{'PASS' if longest * 1000 <= TARGET_MS else 'FAIL'}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
