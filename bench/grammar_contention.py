"""Structured outputs beside hostile grammars: how long a well-behaved request with a grammar the API server has not
seen waits while other clients' grammars keep its grammar checkers busy until --structured-output-check-timeout.

`--hostile K` clients each send one grammar that takes the checker seconds (GBNF of 64 chains of 600 rules, about 13.6 s
to convert, refused at the timeout), all at once and each distinct (the verdict kept for one does not serve the
next); meanwhile one client sends `--requests` small JSON schemas one after another, each new, and each request's
time and status is printed, then their worst and median.

    .venv/bin/python bench/grammar_contention.py                     # sim:1, one API server, 4 hostile clients
    .venv/bin/python bench/grammar_contention.py --hostile 1 --args "--structured-output-check-timeout 2"
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402
from tests.hostile_grammars import slow_gbnf  # noqa: E402


def chat(http: httpx.Client, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return http.post("/v1/chat/completions", json=body)


def schema(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "string"}, "n": {"type": "integer"}},
        "required": [f"field_{i}"]}}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostile", type=int, default=4, help="clients sending a slow grammar each, at once")
    p.add_argument("--requests", type=int, default=6, help="well-behaved requests, one after another")
    p.add_argument("--model", default="sim:1")
    p.add_argument("--args", default="", help="more supervise options")
    args = p.parse_args()
    print(machine_info())
    server = start_supervise(f"--model {args.model} {args.args}")
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            assert chat(http, args.model, response_format=schema(-1)).status_code == 200  # a checker is up
            hostile_status: list[int] = []

            def hostile(i: int) -> None:
                with httpx.Client(base_url=server.url, timeout=600) as own:
                    grammar = slow_gbnf(f"client {i}")
                    hostile_status.append(chat(own, args.model, structured_outputs={"grammar": grammar}).status_code)

            threads = [threading.Thread(target=hostile, args=(i,)) for i in range(args.hostile)]
            for t in threads:
                t.start()
            time.sleep(0.3)  # they are in first
            waits = []
            for i in range(args.requests):
                started = time.monotonic()
                response = chat(http, args.model, response_format=schema(i))
                waits.append(time.monotonic() - started)
                print(f"well-behaved request {i}: {response.status_code} after {waits[-1]:.2f} s")
            for t in threads:
                t.join()
            print(f"hostile requests' statuses: {sorted(hostile_status)}")
            print(f"well-behaved requests beside {args.hostile} hostile clients: worst {max(waits):.2f} s, "
                  f"median {statistics.median(waits):.2f} s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
