"""ZMQ endpoints: each engine core binds one ROUTER; each API server connects one DEALER to every engine,
with identity `api-<index>`, so outputs route back to the server that asked and a restarted server
reconnects under the same identity.

An engine on the supervisor's own node listens on ipc:// in the group's runtime directory (mode 0700); one on a
headless node listens on TCP, authenticated with CURVE when the deployment has a key (ipc/curve.py). TCP
sockets also send ZMTP heartbeats, so a connection to a peer that vanished without a FIN (a network partition,
a powered-off machine) is dropped and retried within seconds instead of hanging on a dead TCP connection. What was
on its way over a dropped connection is lost (a ROUTER drops what it cannot route): the API servers fail the
requests that ran over it (apiserver/engine_links.py)."""
from __future__ import annotations

import os
from typing import Any

import zmq

from ipc.curve import CurveKeys, secure_client, secure_server

# ZMTP heartbeats on TCP: a ping every second, the connection is dropped after 3 s without a word.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


def engine_address(runtime_dir: str, rank: int) -> str:
    """The local address of engine core `rank` (an ipc:// path in the group's runtime directory)."""
    return f"ipc://{os.path.join(runtime_dir, f'engine-{rank}.sock')}"


# The supervisor's own DEALER to every engine (UTILITY `abort_client` when an API server is gone); a headless
# node's supervisor has its own, so that the head's and the node's never take over each other's connection.
SUPERVISOR_IDENTITY = b"supervisor"
NODE_SUPERVISOR_IDENTITY = b"node-supervisor"


def api_server_identity(index: int) -> bytes:
    return f"api-{index}".encode()


def index_of_identity(identity: bytes) -> int:
    return int(identity.decode().rsplit("-", 1)[1])


def tcp_address(host: str, port: int) -> str:
    """tcp://host:port (port 0: any free port, which ZMQ spells `*`); IPv6 hosts in brackets."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port or '*'}"


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def bound_address(sock: zmq.Socket[Any]) -> str:
    """The address a socket really bound (the port ZMQ chose for `*`)."""
    return sock.get_string(zmq.LAST_ENDPOINT)


def bind_router(ctx: zmq.Context[zmq.Socket[Any]], address: str, curve: CurveKeys | None = None,
                max_message_bytes: int = -1) -> zmq.Socket[Any]:
    """`curve`: the deployment's key, used on TCP (ipc:// is guarded by its directory's permissions);
    `max_message_bytes`: a peer that sends a larger message is disconnected (-1: no limit)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # A restarted API server reconnects under the same identity: let the new connection take it over.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    _secure(ctx, sock, address, curve, server=True)
    sock.bind(address)
    return sock


def connect_dealer(ctx: zmq.Context[zmq.Socket[Any]], address: str, identity: bytes, curve: CurveKeys | None = None,
                   immediate: bool = False) -> zmq.Socket[Any]:
    """`immediate`: queue nothing while not connected (a send then raises zmq.Again), for messages that are
    only worth sending now, never later (a headless node's heartbeat)."""
    sock = dealer(ctx, address, identity, curve, immediate)
    sock.connect(address)
    return sock


def dealer(ctx: zmq.Context[zmq.Socket[Any]], address: str, identity: bytes, curve: CurveKeys | None = None,
           immediate: bool = False) -> zmq.Socket[Any]:
    """connect_dealer's socket before it connects (to watch it with a monitor from its first handshake on)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, int(immediate))
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    _secure(ctx, sock, address, curve, server=False)
    return sock


def _secure(ctx: zmq.Context[zmq.Socket[Any]], sock: zmq.Socket[Any], address: str, curve: CurveKeys | None, server: bool) -> None:
    if not is_tcp(address):
        return
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    if curve is not None:
        if server:
            secure_server(ctx, sock, curve)
        else:
            secure_client(sock, curve)
