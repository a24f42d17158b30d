"""Many large request bodies at once against one API server: its peak RSS, how long they took, their statuses.

`--clients K` raw connections each send one whole chat body at the same moment: `text` (one message of 4 million
words, 7.6 MB: tokenized, then refused as too long) or `messages` (250,000 empty messages, 7.9 MB: the parse
weighs some 27 times the body). --max-large-request-bodies-mb bounds what the server holds at once; past it a body
gets 503 before it is read.

    .venv/bin/python bench/large_bodies.py --clients 50 --kind text
    .venv/bin/python bench/large_bodies.py --clients 24 --kind messages --args "--max-large-request-bodies-mb 0"
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from at_once import at_once  # noqa: E402
from machine_info import machine_info  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402


def chat_body(kind: str) -> bytes:
    if kind == "text":
        messages = [{"role": "user", "content": "a " * 4_000_000}]
    else:
        messages = [{"role": "user", "content": ""}] * 250_000
    return json.dumps({"model": "sim:1", "messages": messages, "max_tokens": 1}).encode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--kind", choices=["text", "messages"], default="messages")
    p.add_argument("--args", default="", help="more supervise options")
    args = p.parse_args()
    print(machine_info())
    server = start_supervise(f"--model sim:1 {args.args}")
    try:
        api = server.child_titled("ApiServer_0")
        body = chat_body(args.kind)
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        peak = [api.memory_info().rss]

        def watch(done: threading.Event) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], api.memory_info().rss)
                time.sleep(0.05)

        statuses: Counter = Counter()

        def send() -> None:
            with socket.create_connection(server.address) as sock:
                sock.settimeout(600)
                try:
                    sock.sendall(request)
                except OSError:  # refused before the whole body went: the answer is waiting all the same
                    pass
                head = sock.recv(200).split(b" ")
                statuses[head[1].decode() if len(head) > 1 else "closed"] += 1

        took = at_once(send, args.clients, watch)
        print(f"{args.clients} bodies of {len(body) / 2**20:.1f} MB ({args.kind}) at once: {took:.1f} s, ApiServer_0 peak "
              f"RSS {peak[0] / 2**20:.0f} MB, statuses {dict(sorted(statuses.items()))}, "
              f"server {'alive' if api.is_running() else 'GONE'}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
