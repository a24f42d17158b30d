"""EngineServer: an engine's loop behind its ZMQ ROUTER, the same for the real engine and the simulated one (any
enginecore.engine_base.EngineBase).

One thread does everything, so the socket (not thread-safe) has one owner and there is no lock on the engine:
  - idle: block in poll() until a message, a signal or a compiled grammar comes (no CPU used, no busy polling);
  - busy: take every message already queued (ADD, ABORT, UTILITY) without waiting, run one engine step, and send
    each API server one EngineOutputs with its sequences' new tokens and the engine's load.
Messages that arrive during a step (a forward pass, or the simulated engine waiting for its next tick) wait in
ZMQ's queue and are taken before the next step. A request whose grammar is not compiled yet waits beside the
engine (enginecore.grammar_compiler.CompilingRequests) while a worker thread compiles it, then goes in like any
other. A request the engine cannot take fails alone (an 'error' output); an exception out of a step ends the loop:
the process tells every API server ENGINE_DEAD and exits 1.
"""
from __future__ import annotations

import logging
import signal
import socket
from types import SimpleNamespace

import zmq

from enginecore.engine_base import EngineBase, finished_at_once
from enginecore.grammar_compiler import CompilingRequests
from ipc.codec import MalformedMessage, decode, encode
from ipc.messages import (AbortRequests, EngineDead, EngineOutputs, EngineRequest, FinishReason, Kind, RequestOutput,
                          UtilityCall, UtilityResult)

log = logging.getLogger(__name__)


class EngineServer:
    def __init__(self, core: EngineBase, router: zmq.Socket):
        self.core = core
        self.router = router
        self.clients: set[bytes] = set()  # every API server heard from: they all hear of our death
        self._poller = zmq.Poller()
        self._poller.register(router, zmq.POLLIN)
        # A signal may land on any thread (zmq's, OpenMP's); Python runs its handler in the main thread only
        # once that thread is back in Python, which an idle poll() never is. The wakeup fd makes poll() return.
        self._wakeup, wakeup_write = socket.socketpair()
        wakeup_write.setblocking(False)
        self._wakeup_write = wakeup_write  # kept open for the process's life
        signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
        self._poller.register(self._wakeup, zmq.POLLIN)
        # Requests whose grammar compiles in a worker thread wait here, not in the engine (nothing waits with an
        # engine that takes no grammars: the simulated one).
        self._compiling = CompilingRequests(core.grammar_compiler)
        self._poller.register(self._compiling.fileno(), zmq.POLLIN)
        self._utilities = {
            "ping": lambda: "pong",
            "stats": core.stats,
            "reset_prefix_cache": core.reset_prefix_cache,
            "abort_client": self._abort_client,  # the supervisor's, when an API server died
        }

    def serve_forever(self) -> None:
        while True:
            busy = self.core.has_work()
            events = dict(self._poller.poll(0 if busy else None))
            if self._wakeup in events:
                self._wakeup.recv(4096)  # the signal's handler runs on the way back into Python
            if self._compiling.fileno() in events:  # grammars compiled: their requests go to the engine
                self._admit_compiled()
            if self.router in events:
                self._take_messages()
            if self.core.has_work():
                self._send_outputs(self.core.step())

    def _take_messages(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, payload = frames[0], frames[1:]
            self.clients.add(identity)
            try:
                record = decode(payload)
            except MalformedMessage as exc:  # a malformed message must not kill the engine
                log.warning("ignoring a malformed message from %r: %s", identity, exc)
                self._answer_malformed(identity, payload[0], exc)
                continue
            self._handle(identity, record)

    def _answer_malformed(self, identity: bytes, kind: bytes, exc: MalformedMessage) -> None:
        """An ADD the decoder refused still gets its answer when its id can be read (an 'error' output per choice):
        its API server fails the request instead of waiting for it forever."""
        fields = exc.fields
        if bytes(kind) != Kind.ADD or fields is None or not isinstance(fields.get("request_id"), str):
            return
        sampling = fields.get("sampling")
        # SamplingParams already, when the prompt was what failed its check
        n = sampling.get("n") if isinstance(sampling, dict) else getattr(sampling, "n", None)
        request = SimpleNamespace(request_id=fields["request_id"], prompt_token_ids=None, sampling=SimpleNamespace(n=n))
        self.core.num_failed += 1
        self._send_outputs([(identity, o) for o in finished_at_once(request, FinishReason.ERROR, str(exc))])

    def _handle(self, identity: bytes, record) -> None:
        if isinstance(record, EngineRequest):
            if self._compiling.hold(identity, record):  # its grammar compiles first, off this loop
                return
            self._send_outputs([(identity, o) for o in self.core.add_request(record, identity)])
        elif isinstance(record, AbortRequests):
            outputs = (self._compiling.abort(identity, record.request_ids, record.indices)
                       + self.core.abort(record.request_ids, identity, record.indices))
            self._send_outputs([(identity, o) for o in outputs])
        elif isinstance(record, UtilityCall):
            self._send(identity, self._call(record))
        else:
            log.warning("ignoring a %s from %r: not a request", type(record).__name__, identity)

    def _admit_compiled(self) -> None:
        for identity, request, aborted in self._compiling.ready():
            outputs = self.core.add_request(request, identity)
            if aborted:  # choices aborted while its grammar compiled
                outputs += self.core.abort([request.request_id], identity, aborted)
            self._send_outputs([(identity, o) for o in outputs])

    def _abort_client(self, identity: str) -> int:
        return self._compiling.drop_client(identity.encode()) + self.core.abort_client(identity)

    def _call(self, call: UtilityCall) -> UtilityResult:
        method = self._utilities.get(call.method)
        if method is None:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=method(*call.args))
        except Exception as exc:
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _send_outputs(self, outputs: list[tuple[bytes | None, RequestOutput]]) -> None:
        if not outputs:
            return
        by_client: dict[bytes, list[RequestOutput]] = {}
        for client, output in outputs:
            by_client.setdefault(client, []).append(output)
        load = self.core.load()
        for client, outs in by_client.items():
            self._send(client, EngineOutputs(outs, *load))

    def _send(self, identity: bytes, record) -> None:
        self.router.send_multipart([identity, *encode(record)], copy=False)

    def announce_death(self, reason: str) -> None:
        for identity in self.clients:
            try:
                self._send(identity, EngineDead(reason))
            except zmq.ZMQError:
                pass
