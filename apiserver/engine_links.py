"""Dropped connections to engines on other machines, seen as they happen (a ZMQ socket monitor on each TCP DEALER).

ZMQ hides a dropped connection: the DEALER connects again by itself (ZMTP heartbeats drop a silent one after 3 s,
ipc.sockets), while the engine's ROUTER drops every output addressed to a peer that is not connected, and what was
on the wire when the connection broke is lost too. Requests running over such a link lost outputs without a trace:
a stream waited forever for its last one, or ended as if whole with a gap in its text (an outage of a few seconds
between a head and its node, in a sweep with the link cut). So a drop of an engine's connection fails that
engine's requests in flight at once, with the reason (their aborts go out when the connection is back). A drop is
looked for before every read of the engine's messages, so the outputs that come after the new connection are never
read before it. Local engines (ipc://) have no such link: their connection ends only with the engine itself.
"""
from __future__ import annotations

import asyncio
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.sockets import is_tcp


class EngineLinks:
    """The monitors of the engines' TCP connections (None for a local engine). It holds no callback into the
    engine client: a cycle between them left the client's ZMQ context to the cyclic garbage collector, whose
    clearing of weak references first left its sockets unclosed and its term() waiting forever."""

    def __init__(self, sockets: list[zmq.Socket[Any]], addresses: list[str]):
        self._monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if is_tcp(address) else None
                          for sock, address in zip(sockets, addresses)]

    def watched(self) -> list[tuple[int, int]]:
        """(engine, the file descriptor that signals its monitor's events) for each engine on TCP."""
        return [(engine, monitor.fileno()) for engine, monitor in enumerate(self._monitors) if monitor is not None]

    def drops(self, engine: int) -> int:
        """How many times `engine`'s connection dropped since the last call (the FD only signals a change)."""
        monitor = self._monitors[engine]
        dropped = 0
        while monitor is not None and not monitor.closed:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            dropped += event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        for monitor in self._monitors:
            if monitor is not None and not monitor.closed:
                if loop is not None:
                    loop.remove_reader(monitor.fileno())
                monitor.close(linger=0)
