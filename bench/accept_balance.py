"""How evenly N API servers share keep-alive connections, with and without the accept backoff.

Starts `supervise --model sim:5` (the simulated engine: the balance is a front-end matter) once with
`--accept-backoff-ms 5` and once with 0 (the plain shared socket), opens many keep-alive connections from
many concurrent clients, sends one request on each so it is really accepted and served, then counts each API
server's established connections from the operating system's own tables (psutil), side by side.

    .venv/bin/python bench/accept_balance.py --servers 4 --connections 400
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.supervise_process import Supervise, title_of  # noqa: E402


async def open_connections(host: str, port: int, count: int, clients: int) -> list[asyncio.StreamWriter]:
    """`count` keep-alive connections, opened by `clients` concurrent openers, each with one request served."""
    writers: list[asyncio.StreamWriter] = []
    todo = iter(range(count))

    async def opener() -> None:
        for _ in todo:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: keep-alive\r\n\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
            writers.append(writer)

    await asyncio.gather(*(opener() for _ in range(clients)))
    return writers


def connections_per_server(server: Supervise, port: int) -> dict[str, int]:
    counts = {}
    for child in server.children():
        title = title_of(child)
        if "ApiServer_" not in title:
            continue
        established = [
            c for c in child.net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
        ]
        counts[title.split(": ", 1)[1]] = len(established)
    return dict(sorted(counts.items()))


def measure(servers: int, connections: int, clients: int, backoff_ms: float) -> dict[str, int]:
    server = Supervise("--model", "sim:5", "--api-server-count", str(servers), "--accept-backoff-ms", str(backoff_ms))
    try:
        server.wait_serving()
        host, port = server.url.removeprefix("http://").rsplit(":", 1)

        async def run() -> dict[str, int]:
            writers = await open_connections(host, int(port), connections, clients)
            counts = connections_per_server(server, int(port))
            for w in writers:
                w.close()
            return counts

        return asyncio.run(run())
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=400)
    parser.add_argument("--clients", type=int, default=50, help="concurrent connection openers")
    parser.add_argument("--backoff-ms", type=float, default=5.0)
    args = parser.parse_args()
    results = {
        f"backoff {args.backoff_ms:g} ms": measure(args.servers, args.connections, args.clients, args.backoff_ms),
        "plain shared socket": measure(args.servers, args.connections, args.clients, 0.0),
    }
    names = sorted({name for counts in results.values() for name in counts})
    print(f"{args.connections} keep-alive connections over {args.servers} API servers")
    print(f"{'server':<14}" + "".join(f"{label:>22}" for label in results))
    for name in names:
        print(f"{name:<14}" + "".join(f"{counts.get(name, 0):>22}" for counts in results.values()))
    print(f"{'busiest/idlest':<14}" + "".join(
        f"{max(c.values()) / max(min(c.values()), 1):>22.2f}" for c in results.values()
    ))


if __name__ == "__main__":
    main()
