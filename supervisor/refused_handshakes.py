"""Connections to the registration port whose handshake failed: a node whose --data-parallel-key-file is not the
head's, or that has one where the head has none (or none where it has one).

Such a node never gets as far as the ZAP handler that logs a refused key (ipc/curve.py): with another key, the head
cannot open its first encrypted message; with none, the two sides' mechanisms differ. ZMQ drops the connection
without a word, and the node, hearing nothing, says the head's log names the refusal. So a socket monitor on the
port reports failed handshakes, in one line per kind of failure a minute at most (anyone who can reach the port can
make them, and a refused node retries every few hundred milliseconds). ZMQ does not say the peer's address here.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
# ZMQ's protocol error codes (the event's value) for the two ways a key mismatch shows.
_CRYPTOGRAPHIC = 0x11000001
_MECHANISM_MISMATCH = 0x11000002


class RefusedHandshakes:
    def __init__(self, sock: zmq.Socket[Any], keyed: bool):
        # (Not EVENT_HANDSHAKE_FAILED_NO_DETAIL: a connection cut during the handshake, any peer's doing.)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._keyed = keyed
        self._logged_at: dict[int, float] = {}
        self._since: dict[int, int] = {}  # failures of each kind since its last line

    def fileno(self) -> int:
        return self._monitor.fileno()

    def take(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._failed(int(event["value"]))

    def close(self) -> None:
        self._monitor.close(linger=0)

    def _failed(self, code: int) -> None:
        self._since[code] = self._since.get(code, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(code, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        count, self._since[code] = self._since[code], 0
        self._logged_at[code] = now
        log.warning("refused a connection to the registration port: %s (%d such since the last line; ZMQ does not "
                    "say from where)", self._reason(code), count)

    def _reason(self, code: int) -> str:
        if code == _CRYPTOGRAPHIC:
            return "it does not hold the data-parallel key (a node with another --data-parallel-key-file)"
        if code == _MECHANISM_MISMATCH:
            return ("a node without --data-parallel-key-file, where this head has one" if self._keyed else
                    "a node with a --data-parallel-key-file, where this head has none")
        return f"its handshake failed (ZMQ protocol error {code:#x})"
