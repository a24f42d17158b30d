"""How long a chat of many empty messages holds an API server's event loop (target: no longer than its parse).

250,000 empty messages are a 7.9 MB body, under the 8 MiB limit. Until 2026-12-01 their rendering stayed in the
event loop, because the worker thread was chosen by the messages' text alone, and here that was empty. Everything
ran inline: a validator per message in the parse, the template's dicts and its loop, and 1.4 million ids of role
markers. On the 2-core AMD EPYC VM one such request held the loop 4.1 s and eight at once 7.05 s
(--heartbeat-timeout is 10 s).

This starts a group on `sim:1` with one API server and sends the body `--concurrency` at a time, while a client
asks /health every 20 ms: first for an unknown model (a 404 right after the parse: the floor), then for the served
one (a 400 once its 1.4 million prompt tokens are counted). It prints the longest /health wait of each.

    .venv/bin/python bench/many_messages.py [--messages 250000] [--concurrency 1 8]

Run with PYTHONPATH set to another checkout to measure its code side by side.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from at_once import at_once  # noqa: E402
from tests.supervise_process import Supervise  # noqa: E402


def _longest_health_wait(url: str, body: bytes, concurrency: int) -> tuple[float, float, list]:
    """The longest /health wait while `concurrency` copies of `body` are answered, their time, their statuses."""
    statuses: list = []
    waits: list[float] = []

    def poll(done: threading.Event) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not done.is_set():
                started = time.monotonic()
                http.get("/health")
                waits.append(time.monotonic() - started)
                time.sleep(0.02)

    def send() -> None:
        try:
            response = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=300,
                                  headers={"content-type": "application/json"})
            statuses.append(response.status_code)
        except httpx.HTTPError as exc:  # the API server killed by its watchdog, say
            statuses.append(type(exc).__name__)

    took = at_once(send, concurrency, poll, lead_s=0.5)
    return max(waits), took, sorted(statuses, key=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=250_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    messages = ",".join(['{"role":"user","content":""}', '{"role":"assistant","content":""}'] * (args.messages // 2))
    # Eight bodies at once pass --max-large-request-bodies-mb's default (bench/large_bodies.py measures it): here
    # the event loop's hold under as many as an operator lets in.
    with Supervise("--model", "sim:1", "--api-server-count", "1", "--max-large-request-bodies-mb", "0") as server:
        server.wait_serving()
        print(f"{args.messages:,} empty messages, {len(messages) / 1e6:.1f} MB; the longest /health wait:")
        print("at once  parse only (404)  whole request  whole: seconds until answered, statuses")
        for concurrency in args.concurrency:
            row = []
            for model in ("no-such-model", "sim:1"):
                body = ('{"model": "%s", "max_tokens": 1, "messages": [%s]}' % (model, messages)).encode()
                row.append(_longest_health_wait(server.url, body, concurrency))
            (parse, _, _), (whole, took, statuses) = row
            print(f"{concurrency:7d}  {parse:14.2f} s  {whole:11.2f} s  {took:.1f} s, {statuses}")
        killed = "killing and replacing" in server.log()
    print("the API server was killed by its watchdog" if killed else "the API server was never killed")


if __name__ == "__main__":
    main()
