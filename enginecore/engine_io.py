"""EngineIO: the engine process's I/O thread, the one owner of its ROUTER socket (ZMQ sockets are not thread-safe),
beside the step thread that runs the engine (enginecore.serve_loop), as vLLM's engine core has input and output
threads. A step (a forward pass) may take seconds; meanwhile this thread still:

  - receives and decodes every message, and hands it to the step thread: the inbox (a SimpleQueue) and one ring of
    the inbox doorbell per batch (a socketpair the step thread's poll() waits on while idle: no busy polling);
  - answers UTILITY `ping` and `stats` itself: `stats` from the snapshot the step thread publishes after each step
    and each batch of messages (one attribute assignment of a fresh dict: no lock), so a long step is not mistaken
    for a dead engine by the API servers' pings (apiserver/engine_watch.py);
  - encodes and sends what the step thread posts (the outbox: (identity, record), one doorbell ring per batch),
    overlapped with the next step's compute (torch releases the GIL);
  - remembers every client heard from, which all hear ENGINE_DEAD when the step thread fails.

Wedge detection: the step thread sets `busy_since` when it starts a unit of work (messages + one step) and clears
it before it waits idle. Once one unit has run longer than --engine-step-timeout, pings and stats go unanswered
(logged once), so the API servers' missed-ping logic takes over as for a frozen engine. A SIGSTOPped engine stops
every thread, this one included: it falls silent as before.

The step thread stops this thread with stop(dead_reason): whatever was posted before is sent first, then
ENGINE_DEAD to every client when there is a reason (the socket then lingers 2 s, for ctx.term() to flush it), and the
socket is closed here, by its owner. Signals are blocked in this thread: they land on the step thread, whose poll()
the signal wakeup fd interrupts.
"""
from __future__ import annotations

import logging
import queue
import signal
import socket
import threading
import time
from typing import NamedTuple

import zmq

from ipc.codec import MalformedMessage, decode, encode
from ipc.messages import EngineDead, UtilityCall, UtilityResult

log = logging.getLogger(__name__)

ANSWERED_HERE = ("ping", "stats")  # UTILITY methods this thread answers itself (without arguments)
DEAD_LINGER_MS = 2000  # how long ENGINE_DEAD may take to leave before the process exits


class Doorbell:
    """Wakes another thread's poll(): ring() from any thread, clear() by the waiting one before it drains its
    queue (so a ring for an item put meanwhile is never lost: at worst one spurious wake-up)."""

    def __init__(self):
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        try:
            self._write.send(b"\0")
        except BlockingIOError:  # rung many times already and not cleared yet: one more ring adds nothing
            pass

    def clear(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except BlockingIOError:
            pass


class Malformed(NamedTuple):
    """A message the decoder refused, handed to the step thread (which may still answer it: serve_loop)."""

    kind: bytes
    error: MalformedMessage


class _Stop(NamedTuple):
    dead_reason: str | None


class EngineIO(threading.Thread):
    def __init__(self, router: zmq.Socket, step_timeout: float):
        super().__init__(name="engine-io", daemon=True)  # daemon: a stuck join never keeps the process alive
        self.router = router
        self.step_timeout = step_timeout
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (identity, record | Malformed) for the step thread
        self.inbox_bell = Doorbell()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (identity, record) | _Stop from the step thread
        self._outbox_bell = Doorbell()
        # Written by the step thread, read here: single attribute assignments, atomic under the GIL.
        self.stats: dict = {}
        self.busy_since: float | None = None
        self.error: BaseException | None = None  # this thread failed: the step thread raises it
        self.clients: set[bytes] = set()  # every client heard from: they all hear of our death
        self._silent = False  # past --engine-step-timeout: pings go unanswered

    # --- the step thread's side -----------------------------------------------------------------------------
    def post(self, items: list) -> None:
        """Send each (identity, record) of `items`, in order, from this thread."""
        if items:
            put = self._outbox.put
            for item in items:
                put(item)
            self._outbox_bell.ring()

    def stop(self, dead_reason: str | None = None, timeout: float = 5.0) -> bool:
        """Send what was posted (then ENGINE_DEAD with `dead_reason` to every client heard from), close the socket
        and end the thread. True once the thread has ended (the socket is closed)."""
        if self.is_alive():
            self._outbox.put(_Stop(dead_reason))
            self._outbox_bell.ring()
            self.join(timeout)
        return not self.is_alive()

    # --- this thread ----------------------------------------------------------------------------------------
    def run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
        try:
            self._serve()
        except BaseException as exc:  # a bug here: the step thread raises it, and the engine dies of it
            log.exception("the engine's I/O thread failed")
            self.error = exc
            self.inbox_bell.ring()
        finally:
            self.router.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._outbox_bell.fileno(), zmq.POLLIN)
        outbox, bell = self._outbox, self._outbox_bell.fileno()
        while True:
            events = dict(poller.poll(0 if not outbox.empty() else None))  # items left by a bounded _send_posted
            if bell in events:
                self._outbox_bell.clear()
            if self._send_posted():
                return
            if self.router in events:
                self._receive()

    def _send_posted(self) -> bool:
        """Send what was posted before this call (then receiving gets its turn); True once the step thread asked
        to stop."""
        outbox, send = self._outbox, self.router.send_multipart
        for _ in range(outbox.qsize()):  # what is there now, not more: a fast step thread must not starve receiving
            item = outbox.get()
            if isinstance(item, _Stop):
                self._close(item.dead_reason)
                return True
            identity, record = item
            send([identity, *encode(record)], copy=False)
        return False

    def _close(self, dead_reason: str | None) -> None:
        if dead_reason is not None:
            for identity in self.clients:
                try:
                    self.router.send_multipart([identity, *encode(EngineDead(dead_reason))], copy=False)
                except zmq.ZMQError:
                    pass
            self.router.setsockopt(zmq.LINGER, DEAD_LINGER_MS)
        self.router.close()

    def _receive(self) -> None:
        handed_on = False
        router = self.router
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            identity, payload = frames[0], frames[1:]
            self.clients.add(identity)
            try:
                record = decode(payload)
            except MalformedMessage as exc:  # a malformed message must not kill the engine
                log.warning("ignoring a malformed message from %r: %s", identity, exc)
                self.inbox.put((identity, Malformed(bytes(payload[0]) if payload else b"", exc)))
                handed_on = True
                continue
            if isinstance(record, UtilityCall) and record.method in ANSWERED_HERE and not record.args:
                self._answer(identity, record)
                continue
            self.inbox.put((identity, record))
            handed_on = True
        if handed_on:
            self.inbox_bell.ring()

    def _answer(self, identity: bytes, call: UtilityCall) -> None:
        since = self.busy_since
        busy_for = time.monotonic() - since if since is not None else 0.0
        if busy_for > self.step_timeout:
            if not self._silent:
                self._silent = True
                log.error("stopped answering pings: one engine step has run for %.0f s, past --engine-step-timeout "
                          "(%g s); the API servers will take this engine for gone", busy_for, self.step_timeout)
            return
        if self._silent:
            self._silent = False
            log.warning("the long engine step ended: answering pings again")
        result = "pong" if call.method == "ping" else self.stats
        self.router.send_multipart([identity, *encode(UtilityResult(call.call_id, result=result))], copy=False)
