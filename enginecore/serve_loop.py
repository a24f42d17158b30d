"""EngineServer: an engine's loop behind its ZMQ ROUTER, the same for the real engine and the simulated one (any
enginecore.engine_base.EngineBase).

Two threads. The step thread (the process's main thread, where signals are handled) owns the engine, with no lock:
  - idle: block in poll() until a message, a signal or a compiled grammar comes (no CPU used, no busy polling);
  - busy: take every message already handed over (ADD, ABORT, UTILITY), run one engine step, and post each API
    server one EngineOutputs with its sequences' new tokens and the engine's load.
The I/O thread (enginecore.engine_io.EngineIO) owns the ROUTER: it receives and decodes the messages and hands them
over (a queue and a doorbell this poll() waits on), encodes and sends what the step thread posts (overlapped with
the next step), and answers UTILITY `ping` and `stats` itself, `stats` from the snapshot the step thread publishes
after each step and each batch of messages, before it posts what they produced (so an answer a client has seen is
in every later `stats`). A long step (a big prefill chunk on a CPU) therefore does not look like a dead engine to
the API servers' pings; a step past --engine-step-timeout does (the I/O thread stops answering). Other utilities
(reset_prefix_cache, abort_client) run here, between steps.

A request whose grammar is not compiled yet waits beside the engine (enginecore.grammar_compiler.CompilingRequests)
while a worker thread compiles it, then goes in like any other. A request the engine cannot take fails alone (an
'error' output); an exception out of a step ends the loop: close(reason) has the I/O thread tell every API server
ENGINE_DEAD, and the process exits 1.
"""
from __future__ import annotations

import logging
import select
import signal
import socket
import time
from types import SimpleNamespace

import zmq

from enginecore.engine_base import EngineBase, finished_at_once
from enginecore.engine_io import EngineIO, Malformed
from enginecore.grammar_compiler import CompilingRequests
from enginecore.heap_trim import HeapTrim
from enginecore.step_stats import StepStatsLog
from ipc.codec import MalformedMessage
from ipc.messages import (AbortRequests, EngineOutputs, EngineRequest, FinishReason, Kind, RequestOutput, UtilityCall,
                          UtilityResult)

log = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT = 300.0  # ipc.config.ServeConfig.engine_step_timeout's default


class EngineIOFailed(RuntimeError):
    """The I/O thread failed: nothing reaches the engine any more, so it dies like one whose step raised."""


class EngineServer:
    def __init__(self, core: EngineBase, router: zmq.Socket, step_timeout: float = DEFAULT_STEP_TIMEOUT,
                 log_stats_interval: float = 0.0):
        self.core = core
        # A line of activity in the log every log_stats_interval seconds while the engine works (0: none).
        self.stats_log = StepStatsLog(core.step_counts, log_stats_interval, core.load) if log_stats_interval > 0 \
            else None
        self.io = EngineIO(router, step_timeout)  # the socket is the I/O thread's from serve_forever() on
        self._heap_trim = HeapTrim()
        self._posted: list[tuple[bytes, object]] = []  # what this batch of work sends, once the stats are published
        self._poller = select.poll()
        self._poller.register(self.io.inbox_bell.fileno(), select.POLLIN)
        # A signal may land on any thread (zmq's, OpenMP's); Python runs its handler in the main thread only
        # once that thread is back in Python, which an idle poll() never is. The wakeup fd makes poll() return.
        self._wakeup, wakeup_write = socket.socketpair()
        wakeup_write.setblocking(False)
        self._wakeup_write = wakeup_write  # kept open for the process's life
        signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
        self._poller.register(self._wakeup.fileno(), select.POLLIN)
        # Requests whose grammar compiles in a worker thread wait here, not in the engine (nothing waits with an
        # engine that takes no grammars: the simulated one).
        self._compiling = CompilingRequests(core.grammar_compiler)
        self._poller.register(self._compiling.fileno(), select.POLLIN)
        self._utilities = {
            "ping": lambda: "pong",  # answered by the I/O thread, unless called with arguments (an error then)
            "stats": core.stats,
            "reset_prefix_cache": core.reset_prefix_cache,
            "abort_client": self._abort_client,  # the supervisor's, when an API server died
        }
        self.io.stats = core.stats()

    def serve_forever(self) -> None:
        io, poll, core = self.io, self._poller.poll, self.core
        bell, wakeup, compiling = io.inbox_bell.fileno(), self._wakeup.fileno(), self._compiling.fileno()
        io.start()
        while True:
            busy = core.has_work()
            if not busy:
                io.busy_since = None  # waiting is not a step: never a wedge
            self._heap_trim.after_work(idle=not busy)  # freed memory back to the kernel, now and then
            events = poll(0 if busy else self._idle_wait_ms())
            io.busy_since = time.monotonic()
            for fd, _ in events:
                if fd == bell:
                    io.inbox_bell.clear()
                elif fd == wakeup:
                    self._wakeup.recv(4096)  # the signal's handler runs on the way back into Python
                elif fd == compiling:  # grammars compiled: their requests go to the engine
                    self._admit_compiled()
            if not busy and self.stats_log is not None:
                self.stats_log.write_if_due()  # the last line of a busy spell, once its interval is over
            if io.error is not None:
                raise EngineIOFailed(f"the I/O thread failed: {type(io.error).__name__}: {io.error}")
            if self._take_messages() or self._posted:  # admissions, aborts, utilities: their stats first
                self._publish()
            if core.has_work():
                started = time.perf_counter()
                self._send_outputs(core.step())
                self._publish()
                if self.stats_log is not None:
                    self.stats_log.stepped(time.perf_counter() - started)

    def _idle_wait_ms(self) -> int | None:
        """How long an idle poll() may block: for ever, unless a line of activity falls due meanwhile."""
        due = self.stats_log.due_in() if self.stats_log is not None else None
        return None if due is None else int(due * 1000) + 1

    def close(self, dead_reason: str | None = None) -> bool:
        """Stop the I/O thread, which sends what was posted (and ENGINE_DEAD to every client heard from when
        `dead_reason` is given) and closes the socket. True once the socket is closed."""
        if self.io.ident is None:  # serve_forever never started it: the socket is still this thread's
            self.io.router.close(linger=0)
            return True
        return self.io.stop(dead_reason)

    def _publish(self) -> None:
        """The stats snapshot first, then what this work produced: whatever a client has heard of is in `stats`."""
        self.io.stats = self.core.stats()
        posted, self._posted = self._posted, []
        self.io.post(posted)

    def _take_messages(self) -> bool:
        """Handle every message the I/O thread handed over; True if there was any."""
        inbox = self.io.inbox
        if inbox.empty():
            return False
        while not inbox.empty():
            identity, record = inbox.get()
            if isinstance(record, Malformed):
                self._answer_malformed(identity, record.kind, record.error)
            else:
                self._handle(identity, record)
        return True

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
            self._posted.append((identity, self._call(record)))
        else:
            log.warning("ignoring a %s from %r: not a request", type(record).__name__, identity)

    def _admit_compiled(self) -> None:
        for identity, request, aborted in self._compiling.ready():
            outputs = self.core.add_request(request, identity)
            if aborted:  # choices aborted while its grammar compiled
                outputs += self.core.abort([request.request_id], identity, aborted)
            self._send_outputs([(identity, o) for o in outputs])
        self._publish()

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
        """Post each client one EngineOutputs with its outputs (sent once the stats are published)."""
        if not outputs:
            return
        by_client: dict[bytes, list[RequestOutput]] = {}
        for client, output in outputs:
            by_client.setdefault(client, []).append(output)
        load = self.core.load()
        for client, outs in by_client.items():
            self._posted.append((client, EngineOutputs(outs, *load)))
