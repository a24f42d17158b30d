"""The supervisor's own line to the engine cores: one DEALER per engine, identity `supervisor` (a headless
node's supervisor uses `node-supervisor`, so that the head's and the node's lines to one engine never take
over each other's identity).

It is used for three things. It pings each engine (supervisor/engine_liveness.py asks how long each has left a ping
unanswered). A headless node told to stop asks its engines for their `stats` until they run nothing
(supervisor/node_drain.py). And when an API server is gone (it died, or the watchdog killed it, or it drained and
exited), every engine aborts the requests of that server's identity (UTILITY `abort_client`), so no engine
decodes on for a reader that no longer exists. A headless node uses it when a new head appears: the old head's
API servers are all gone, so their requests are aborted on the node's engines. Calls are sent without waiting; the answers are read whenever
the supervisor's event source wakes (these sockets are among what it waits on) and only logged.

A replacement at the same index cannot lose its own requests to this abort: the abort is queued before the
replacement is even started, and the replacement sends no request before the engine has answered its ping,
which the engine can only do while draining its socket, after the abort that arrived first.
"""
from __future__ import annotations

import itertools
import logging
import time

import zmq

from ipc.codec import MalformedMessage, decode, encode
from ipc.curve import CurveKeys
from ipc.messages import EngineDead, UtilityCall, UtilityResult
from ipc.shared_state import MAX_SLOTS
from ipc.sockets import SUPERVISOR_IDENTITY, api_server_identity, connect_dealer

log = logging.getLogger(__name__)


class EngineLink:
    def __init__(self, engine_addresses: dict[int, str], curve: CurveKeys | None = None,
                 identity: bytes = SUPERVISOR_IDENTITY):
        """`engine_addresses`: rank -> address; `curve`: the deployment's key, for engines on TCP."""
        self._zmq = zmq.Context(io_threads=1)
        self._curve = curve
        self._identity = identity
        self._sockets = {rank: connect_dealer(self._zmq, address, identity, curve)
                         for rank, address in engine_addresses.items()}
        self._call_ids = itertools.count(1)
        self._calls: dict[int, tuple[int, str, bool]] = {}  # call id -> (rank, identity whose work it aborts, quiet)
        self._pings: dict[int, int] = {}  # call id -> rank
        self._stats_calls: dict[int, tuple[int, float]] = {}  # call id -> (rank, when it was asked)
        self.stats: dict[int, tuple[float, dict]] = {}  # rank -> (when asked, answer) of its latest stats answered
        # rank -> when the oldest ping it has not answered went out (None: it answered since the last one)
        self._asked_since: dict[int, float | None] = {rank: None for rank in engine_addresses}

    def filenos(self) -> list[int]:
        return [sock.fileno() for sock in self._sockets.values()]

    def reconnect(self, rank: int, address: str) -> None:
        """Engine `rank` listens at a new address (its node registered again)."""
        old = self._sockets.pop(rank, None)
        if old is not None:
            old.close(linger=0)
        self._sockets[rank] = connect_dealer(self._zmq, address, self._identity, self._curve)
        self._asked_since[rank] = None

    def ping(self, rank: int) -> None:
        """Ping engine `rank`; silent_for(rank) counts from the first ping it leaves unanswered."""
        call_id = next(self._call_ids)
        if self._asked_since[rank] is None:
            self._asked_since[rank] = time.monotonic()
        try:
            self._sockets[rank].send_multipart(encode(UtilityCall(call_id, "ping", [])), zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # a full queue: the engine is not reading, which its silence will say
        self._pings[call_id] = rank
        self.take_answers()  # as in abort_client: keep the FD's edge

    def ask_stats(self, rank: int) -> None:
        """Ask engine `rank` for its stats (num_running, num_waiting...); `stats[rank]` holds the answer once read."""
        call_id = next(self._call_ids)
        try:
            self._sockets[rank].send_multipart(encode(UtilityCall(call_id, "stats", [])), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        self._stats_calls[call_id] = (rank, time.monotonic())
        self.take_answers()

    def silent_for(self, rank: int, now: float) -> float:
        """Seconds engine `rank` has left a ping unanswered (0 when it answered since the last one): counted from
        the ping, not from its last answer, since before a ping it had no reason to speak."""
        since = self._asked_since[rank]
        return 0.0 if since is None else now - since

    def abort_every_client(self) -> None:
        """Abort the requests of every API server identity there can be (a new head: all of them are gone)."""
        for index in range(MAX_SLOTS):
            self.abort_client(api_server_identity(index), quiet=True)

    def abort_client(self, identity: bytes, quiet: bool = False) -> None:
        """Ask every engine to abort the requests of `identity` (api-<index>); the answers are logged later
        (`quiet`: only those that aborted something)."""
        name = identity.decode()
        for rank, sock in self._sockets.items():
            call_id = next(self._call_ids)
            try:
                sock.send_multipart(encode(UtilityCall(call_id, "abort_client", [name])), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not ask EngineCore_DP%d to abort the requests of %s: %s", rank, name, exc)
                continue
            self._calls[call_id] = (rank, name, quiet)
        self.take_answers()  # a send can swallow the FD's edge: read now so the next answer raises it again

    def take_answers(self) -> None:
        for rank, sock in self._sockets.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    record = decode(frames)
                except MalformedMessage as exc:
                    log.warning("ignoring a malformed message from EngineCore_DP%d: %s", rank, exc)
                    continue
                self._asked_since[rank] = None  # any message says it reads and answers
                if isinstance(record, UtilityResult) and isinstance(record.call_id, int):  # remote engines' too
                    stats_call = self._stats_calls.pop(record.call_id, None)
                    if stats_call is not None:
                        if isinstance(record.result, dict):
                            self.stats[stats_call[0]] = (stats_call[1], record.result)
                    elif self._pings.pop(record.call_id, None) is None:
                        self._on_result(record)
                elif not isinstance(record, EngineDead):  # a dead engine's sentinel tells us that too
                    log.warning("ignoring a %s from EngineCore_DP%d", type(record).__name__, rank)

    def _on_result(self, result: UtilityResult) -> None:
        call = self._calls.pop(result.call_id, None)
        if call is None:
            return
        rank, name, quiet = call
        if result.error is not None:
            log.warning("EngineCore_DP%d could not abort the requests of %s: %s", rank, name, result.error)
        elif not quiet or result.result:
            log.info("EngineCore_DP%d aborted %s request(s) of %s, which is gone", rank, result.result, name)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._zmq.term()
