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
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.sockets import is_tcp


class EngineLinks:
    """The monitors of the engines' TCP connections; `on_drop(engine)` for each connection that dropped."""

    def __init__(self, sockets: list[zmq.Socket[Any]], addresses: list[str], on_drop: Callable[[int], None]):
        self._monitors = [sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if is_tcp(address) else None
                          for sock, address in zip(sockets, addresses)]
        self._on_drop = on_drop

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        for engine, monitor in enumerate(self._monitors):
            if monitor is not None:
                loop.add_reader(monitor.fileno(), self.check, engine)

    def check(self, engine: int) -> None:
        """Every drop of `engine`'s connection reported since the last check (the FD only signals a change)."""
        monitor = self._monitors[engine]
        while monitor is not None and not monitor.closed:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on_drop(engine)

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        for monitor in self._monitors:
            if monitor is not None and not monitor.closed:
                if loop is not None:
                    loop.remove_reader(monitor.fileno())
                monitor.close(linger=0)
