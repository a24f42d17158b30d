"""The API server's side of the IPC contract: one DEALER per engine core, read from the event loop directly.

The sockets are plain (blocking-API) ZMQ sockets used only with NOBLOCK: the loop watches each socket's FD
and, when it signals, a callback drains every waiting message. zmq.asyncio would cost a future, a few
callbacks and a dozen enum operations per message, on the path of every engine step. ZMQ's FD is
edge-triggered and a send can consume the edge of an incoming message, so after every send the socket is
checked for input too. A drain works in slices of DRAIN_SLICE_SECONDS: an engine that outpaces this server
(hundreds of outputs per millisecond) would otherwise keep one drain going forever and starve everything
else on the loop, the heartbeat included; a slice that stops with messages left schedules the next one,
since the FD will not signal again for them.

Each request gets a RequestStream (a list plus a future, lighter than an asyncio.Queue) that the reader
fills with the request's RequestOutputs as they arrive, one batch per engine step. A request goes to the least
loaded engine, counted as this server's requests in flight there plus what the engine last reported waiting.
ENGINE_DEAD (or the supervisor marking an engine dead in shared memory) fails every waiting request at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq

from ipc import codec
from ipc.messages import AbortRequests, EngineDead, EngineOutputs, EngineRequest, UtilityCall, UtilityResult
from ipc.sampling import SamplingParams
from ipc.sockets import api_server_identity, connect_dealer

log = logging.getLogger(__name__)

# One drain handles messages for at most this long, then lets the loop run (a 128-output message takes
# about 0.3 ms to decode and hand out, so a slice is a dozen or more engine steps). zmq.asyncio, as vLLM
# uses it, yields after every message; a slice keeps that fairness without a future per message.
DRAIN_SLICE_SECONDS = 0.005


class EngineDeadError(Exception):
    """The engine core serving a request is gone."""


class EngineRequestError(Exception):
    """The engine failed one of a request's sequences (FinishReason.ERROR); the message is its reason. Here
    with the engine's other errors, so that the error table (apiserver/errors.py) needs no detokenizer."""


class RequestAborted(Exception):
    """This server stopped the request (client disconnect, a stop string, shutdown)."""


class RequestStream:
    """The outputs of one API request's engine requests (one per prompt), in arrival order, for one consumer."""

    __slots__ = ("engines", "unfinished", "_items", "_waiter", "_error", "_loop")

    def __init__(self, engines: dict[str, int], num_sequences: int, loop: asyncio.AbstractEventLoop):
        self.engines = engines  # engine request id -> the engine that runs it
        self.unfinished = dict.fromkeys(engines, num_sequences)  # engine request id -> sequences still running
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._loop = loop

    def put(self, output) -> None:
        self._items.append(output)
        if output.finish_reason is not None:
            self.unfinished[output.request_id] -= 1
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self, timeout: float | None = None) -> list:
        """Every output that arrived since the last call; waits while there is none. [] after `timeout`."""
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout, self._wake) if timeout is not None else None
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if timeout is not None and not self._items and self._error is None:
                return []
        items, self._items = self._items, []
        return items


class EngineClient:
    def __init__(self, addresses: list[str], index: int, on_in_flight=None):
        self._ctx = zmq.Context()
        identity = api_server_identity(index)
        self._sockets = [connect_dealer(self._ctx, address, identity) for address in addresses]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = [False] * len(addresses)
        self._streams: dict[str, RequestStream] = {}
        self._in_flight = [0] * len(addresses)  # this server's requests at each engine
        self._waiting = [0] * len(addresses)  # what each engine last reported waiting
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._on_in_flight = on_in_flight  # called with the number of requests in flight, on every change
        self.dead_reason: str | None = None
        self._unanswered: dict[int, str] = {}  # engine rank -> why it counts as not answering (missed pings)

    # Life cycle.
    async def start(self, ping_timeout: float) -> None:
        """Start reading, then ping every engine: returns once all answered, raises TimeoutError if not."""
        self._loop = asyncio.get_running_loop()
        for engine, sock in enumerate(self._sockets):
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain, engine)
        await asyncio.wait_for(
            asyncio.gather(*(self.call_utility(i, "ping") for i in range(len(self._sockets)))), ping_timeout
        )

    async def close(self) -> None:
        for sock in self._sockets:
            if self._loop is not None and not sock.closed:
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

    @property
    def num_engines(self) -> int:
        return len(self._sockets)

    @property
    def num_in_flight(self) -> int:
        """Engine requests of this server in flight (one per prompt of each API request)."""
        return len(self._streams)

    # Requests.
    def generate(self, requests: list[tuple[str, list[int]]], sampling: SamplingParams, priority: int = 0) -> RequestStream:
        """Send each (engine request id, prompt token ids) to the least loaded engine; the caller reads the
        returned stream and must call `release` when done with it."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        for request_id, _ in requests:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
        engines = {}
        for request_id, _ in requests:
            engine = engines[request_id] = self._least_loaded()
            self._in_flight[engine] += 1
        stream = RequestStream(engines, max(1, sampling.n), asyncio.get_running_loop())
        for request_id, prompt_token_ids in requests:
            self._streams[request_id] = stream
            self._send(engines[request_id], EngineRequest(request_id, prompt_token_ids, sampling, priority))
        self._in_flight_changed()
        return stream

    def release(self, stream: RequestStream) -> None:
        """The consumer is done with `stream`: forget it, and abort in the engine what did not finish there."""
        aborts: dict[int, list[str]] = {}
        for request_id, engine in stream.engines.items():
            if self._streams.pop(request_id, None) is None:
                continue
            self._in_flight[engine] -= 1
            if stream.unfinished[request_id] > 0:
                aborts.setdefault(engine, []).append(request_id)
        if self.dead_reason is None:
            for engine, request_ids in aborts.items():
                self._send(engine, AbortRequests(request_ids))
        self._in_flight_changed()

    def abort(self, stream: RequestStream, request_id: str, indices: list[int] | None = None) -> None:
        """Stop `request_id` of `stream` in its engine now (only its choices `indices`, when given), while
        the stream stays open for what is on its way; `release` still ends it."""
        if self.dead_reason is None and request_id in self._streams:
            self._send(stream.engines[request_id], AbortRequests([request_id], indices))

    async def call_utility(self, engine: int, method: str, *args, timeout: float | None = None):
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(engine, UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def mark_dead(self, reason: str) -> None:
        """Every waiting request fails now, and every later one at once."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("engine core is dead: %s", reason)
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.fail(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def set_unanswered(self, engine: int, reason: str | None) -> None:
        """engine_watch's verdict on `engine`: why it is not answering pings now, or None once it does."""
        if reason is None:
            self._unanswered.pop(engine, None)
        else:
            self._unanswered[engine] = reason

    @property
    def unanswered_reason(self) -> str | None:
        """Why an engine is not answering pings now (it may still be alive: /health says 503 meanwhile)."""
        return next(iter(self._unanswered.values()), None)

    # Internals.
    def _least_loaded(self) -> int:
        if len(self._sockets) == 1:
            return 0
        loads = [self._in_flight[i] + self._waiting[i] for i in range(len(self._sockets))]
        return loads.index(min(loads))

    def _send(self, engine: int, record) -> None:
        # SNDHWM is 0 (no limit): the send never has to wait.
        sock = self._sockets[engine]
        sock.send_multipart(codec.encode(record), flags=zmq.NOBLOCK, copy=False)
        # The send may have taken the FD's edge for a message that came in meanwhile: look for one soon.
        if not self._drain_scheduled[engine] and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain(engine)

    def _schedule_drain(self, engine: int) -> None:
        if not self._drain_scheduled[engine]:
            self._drain_scheduled[engine] = True
            self._loop.call_soon(self._drain, engine)

    def _in_flight_changed(self) -> None:
        if self._on_in_flight is not None:
            self._on_in_flight(len(self._streams))

    def _drain(self, engine: int) -> None:
        """The messages waiting on `engine`'s socket, handled until none is left (the FD only signals a
        change) or the slice is over; then the rest waits for a drain scheduled after what else is ready."""
        self._drain_scheduled[engine] = False
        sock = self._sockets[engine]
        slice_ends = time.monotonic() + DRAIN_SLICE_SECONDS
        while not sock.closed:
            if time.monotonic() >= slice_ends:
                self._schedule_drain(engine)
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                record = codec.decode(frames)
            except codec.MalformedMessage as exc:
                log.error("dropped a malformed message from engine %d: %s", engine, exc)
                continue
            try:
                self._handle(engine, record)
            except Exception:  # a bug here must not leave the rest of the messages unread
                log.exception("handling a message from engine %d failed", engine)

    def _handle(self, engine: int, record) -> None:
        if isinstance(record, EngineOutputs):
            self._waiting[engine] = record.num_waiting
            streams = self._streams
            for output in record.outputs:
                stream = streams.get(output.request_id)
                if stream is not None:  # else: released (aborted) while this step ran
                    stream.put(output)
        elif isinstance(record, UtilityResult):
            future = self._calls.get(record.call_id)
            if future is not None and not future.done():
                if record.error is not None:
                    future.set_exception(RuntimeError(record.error))
                else:
                    future.set_result(record.result)
        elif isinstance(record, EngineDead):
            self.mark_dead(f"engine core DP{engine}: {record.reason}")
