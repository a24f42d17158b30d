"""ZMQ endpoints: each engine core binds one ROUTER; each API server connects one DEALER to every engine,
with identity `api-<index>`, so outputs route back to the server that asked and a restarted server
reconnects under the same identity."""
from __future__ import annotations

import os

import zmq


def engine_address(runtime_dir: str, rank: int) -> str:
    """The local address of engine core `rank` (an ipc:// path in the group's runtime directory)."""
    return f"ipc://{os.path.join(runtime_dir, f'engine-{rank}.sock')}"


# The supervisor's own DEALER to every engine (UTILITY `abort_client` when an API server is gone).
SUPERVISOR_IDENTITY = b"supervisor"


def api_server_identity(index: int) -> bytes:
    return f"api-{index}".encode()


def index_of_identity(identity: bytes) -> int:
    return int(identity.decode().rsplit("-", 1)[1])


def bind_router(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # A restarted API server reconnects under the same identity: let the new connection take it over.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(address)
    return sock


def connect_dealer(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock
