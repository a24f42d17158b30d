"""The API server's side of the IPC contract: one DEALER per engine core, read from the event loop directly.

The sockets are plain (blocking-API) ZMQ sockets used only with NOBLOCK: the loop watches each socket's FD
and, when it signals, a callback drains every waiting message. zmq.asyncio would cost a future, a few
callbacks and a dozen enum operations per message, on the path of every engine step. ZMQ's FD is
edge-triggered and a send can consume the edge of an incoming message, so after every send the socket is
checked for input too. A drain works in slices of DRAIN_SLICE_SECONDS: an engine that outpaces this server
(hundreds of outputs per millisecond) would otherwise keep one drain going forever and starve everything
else on the loop, the heartbeat included; a slice that stops with messages left schedules the next one,
since the FD will not signal again for them.

Each request gets a RequestStream (apiserver/request_stream.py) that the reader fills with the request's
outputs as they arrive, one batch per engine step. A request goes to the least
loaded engine (apiserver/engine_loads.py states the rule), or to the data-parallel rank its caller names.
An engine that is down (ENGINE_DEAD, the supervisor's mark in shared memory, missed pings) fails the requests
it runs at once and gets no more; the others serve on. A remote engine whose connection dropped (and came back)
fails the requests it ran then, whose outputs may have been lost on the way (apiserver/engine_links.py). Down is
final for this server: a rank that comes back (a headless node that registered again) is reached by the API
servers the supervisor starts after it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq

from apiserver.engine_errors import EngineDeadError, StreamBacklogFull, UnknownRank
from apiserver.engine_links import EngineLinks
from apiserver.engine_loads import EngineLoads, GroupInFlight
from apiserver.request_stream import Backlogs, RequestStream
from ipc import codec
from ipc.curve import CurveKeys
from ipc.launch import ApiServerLaunch
from ipc.messages import AbortRequests, EngineDead, EngineOutputs, EngineRequest, UtilityCall, UtilityResult
from ipc.sampling import SamplingParams
from ipc.shared_state import GroupState
from ipc.sockets import api_server_identity, connect_dealer

log = logging.getLogger(__name__)

# One drain handles messages for at most this long, then lets the loop run (a 128-output message takes
# about 0.3 ms to decode and hand out, so a slice is a dozen or more engine steps). zmq.asyncio, as vLLM
# uses it, yields after every message; a slice keeps that fairness without a future per message.
DRAIN_SLICE_SECONDS = 0.005
# How long close() lets the requests it failed write their error to their clients.
_CLOSE_GRACE_SECONDS = 0.5


class EngineClient:
    def __init__(self, addresses: list[str], index: int, on_in_flight=None, ranks: list[int] | None = None,
                 curve: CurveKeys | None = None, group: GroupInFlight | None = None,
                 backlogs: Backlogs | None = None, marks: GroupState | None = None):
        """`ranks`: the data-parallel rank of each address (default 0, 1, ...); `curve`: the key for TCP ones;
        `group`: the group's in-flight counters per rank, which the balancer reads (apiserver/engine_loads.py);
        `backlogs`: how much of a stream's outputs (--max-stream-backlog-mb), and of all streams' together
        (--max-total-stream-backlog-mb), may wait for their consumers before a request is aborted;
        `marks`: where the supervisor marks ranks down or draining, read when a connection drops (its node may have
        left, or stopped draining, before this server took the mark)."""
        self.backlogs = backlogs if backlogs is not None else Backlogs()
        self._ctx = zmq.Context()
        identity = api_server_identity(index)
        self._sockets = [connect_dealer(self._ctx, address, identity, curve) for address in addresses]
        self._links = EngineLinks(self._sockets, list(addresses))
        self.addresses = list(addresses)
        self.ranks = list(ranks) if ranks else list(range(len(addresses)))
        self._position = {rank: i for i, rank in enumerate(self.ranks)}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = [False] * len(addresses)
        self._streams: dict[str, RequestStream] = {}
        self._to_hand: list[RequestStream] = []  # streams with outputs held for their handler (RequestStream)
        self.loads = EngineLoads(self.ranks, group)
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (engine, its answer)
        self._call_ids = itertools.count(1)
        self._on_in_flight = on_in_flight  # called with the number of requests in flight, on every change
        self.down: dict[int, str] = {}  # engine (position) -> why it is down, for good
        self._unanswered: dict[int, str] = {}  # engine -> why it counts as not answering (missed pings)
        # engine -> why it takes no new requests: its node is stopping. Its running ones finish; it is still pinged.
        self.draining: dict[int, str] = {}
        self._marks = marks

    @classmethod
    def for_launch(cls, launch: ApiServerLaunch, group: GroupState) -> "EngineClient":
        """The engine client of the API server `launch` starts (HTTP or gRPC alike): every rank of the group, its
        in-flight count published in the server's shared-memory slot."""
        index = launch.index
        return cls(list(launch.engine_addresses), index, on_in_flight=lambda n: group.set_in_flight(index, n),
                   ranks=list(launch.engine_ranks), curve=launch.curve, group=GroupInFlight(group, index),
                   backlogs=Backlogs(launch.config.max_stream_backlog_mb * 2**20,
                                     launch.config.max_total_stream_backlog_mb * 2**20),
                   marks=group)

    # Life cycle.
    async def start(self, ping_timeout: float) -> None:
        """Start reading, then ping every engine not down: returns once all answered, raises TimeoutError if not."""
        self._loop = asyncio.get_running_loop()
        for engine, sock in enumerate(self._sockets):
            self._loop.add_reader(sock.fileno(), self._drain, engine)
        for engine, fd in self._links.watched():
            self._loop.add_reader(fd, self._check_link, engine)
        await asyncio.wait_for(
            asyncio.gather(*(self.call_utility(i, "ping") for i in self.usable())), ping_timeout
        )

    async def close(self) -> None:
        """The server is past its stop. Requests still in flight fail first (a forced stop leaves them: a second
        signal, or the supervisor's death, which sends two), and get a moment to say so to their clients: left to
        the loop's end, each was cancelled with a traceback in the log and its stream cut without a word."""
        if self._streams:
            self.fail_in_flight("the API server stopped before the request finished")
            deadline = time.monotonic() + _CLOSE_GRACE_SECONDS
            while self._streams and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        for sock in self._sockets:
            if self._loop is not None and not sock.closed:
                self._loop.remove_reader(sock.fileno())
        self._links.close(self._loop)
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

    def usable(self) -> list[int]:
        """The engines (positions) that are not down."""
        return [i for i in range(len(self._sockets)) if i not in self.down]

    @property
    def dead_reason(self) -> str | None:
        """Why this server cannot serve at all (every engine is down), else None."""
        if len(self.down) < len(self._sockets):
            return None
        return "; ".join(self.down[i] for i in sorted(self.down))

    # Requests.
    def generate(self, requests: list[tuple[str, list[int]]], sampling: SamplingParams, priority: int = 0,
                 rank: int | None = None) -> RequestStream:
        """Send each (engine request id, prompt token ids) to the least loaded engine, or to data-parallel `rank`
        (UnknownRank if this group has none such, EngineDeadError if it is down); the caller reads the returned
        stream and must call `release` when done with it."""
        pinned = self.engine_of_rank(rank) if rank is not None else None
        if pinned is None:
            unavailable = self.dead_reason or self.draining_reason
            if unavailable is not None:
                raise EngineDeadError(unavailable)
        for request_id, _ in requests:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
        # Encoded before anything counts: a record that cannot be (an integer past 64 bits that a front end let
        # through) fails the request here, not after it was counted in flight for good.
        # Prompt i's choices are sequences i * n to i * n + n - 1 of this request: the engine's fair share counts
        # them so (ipc.messages.EngineRequest.ordinal).
        n = max(1, sampling.n)
        messages = [(request_id, codec.encode(EngineRequest(request_id, prompt_token_ids, sampling, priority, i * n)))
                    for i, (request_id, prompt_token_ids) in enumerate(requests)]
        engines = {}
        for request_id, _ in requests:
            engine = engines[request_id] = pinned if pinned is not None else self._least_loaded()
            self.loads.sent(engine)
        stream = RequestStream(engines, max(1, sampling.n), asyncio.get_running_loop(), self._to_hand, self.backlogs)
        for request_id, frames in messages:
            self._streams[request_id] = stream
            self._send_frames(engines[request_id], frames)
        self._in_flight_changed()
        return stream

    def ranks_of(self, stream: RequestStream) -> list[int]:
        """The data-parallel rank each engine request of `stream` went to."""
        return [self.ranks[engine] for engine in stream.engines.values()]

    def engine_of_rank(self, rank: int) -> int:
        """The position of data-parallel `rank`, which must be up: UnknownRank / EngineDeadError otherwise."""
        engine = self._position.get(rank)
        if engine is None:
            served = ", ".join(map(str, self.ranks))
            raise UnknownRank(f"data-parallel rank {rank} is not served here (ranks: {served})")
        if engine in self.down:
            raise EngineDeadError(f"data-parallel rank {rank} is down: {self.down[engine]}")
        if engine in self.draining:
            raise EngineDeadError(f"data-parallel rank {rank} takes no new requests: {self.draining[engine]}")
        return engine

    def release(self, stream: RequestStream) -> None:
        """The consumer is done with `stream`: forget it, and abort in the engine what did not finish there."""
        stream.drop_backlog()
        aborts: dict[int, list[str]] = {}
        for request_id, engine in stream.engines.items():
            if self._streams.pop(request_id, None) is None:
                continue
            self.loads.done(engine)
            if stream.unfinished[request_id] > 0:
                aborts.setdefault(engine, []).append(request_id)
        for engine, request_ids in aborts.items():
            if engine not in self.down:
                self._send(engine, AbortRequests(request_ids))
        self._in_flight_changed()

    def _end_for_backlog(self, stream: RequestStream) -> None:
        """`stream`'s client reads slower than its engines write: stop them and drop what waits (RequestStream)."""
        mb = self.backlogs.stream_limit // 2**20
        self._end_backlogged(stream, f"--max-stream-backlog-mb {mb}", f"at most {mb} MB")

    def _end_largest_backlogs(self) -> None:
        """All streams' outputs waiting for their consumers passed --max-total-stream-backlog-mb: end the streams
        that hold most, until the rest fit (the clients most behind: a client that keeps up holds next to none)."""
        backlogs = self.backlogs
        mb = backlogs.total_limit // 2**20
        streams = sorted({id(s): s for s in self._streams.values()}.values(), key=lambda s: s.backlog, reverse=True)
        for stream in streams:
            if not backlogs.over_total or not stream.backlog:
                return
            self._end_backlogged(stream, f"--max-total-stream-backlog-mb {mb}",
                                 f"this server's streams together at most {mb} MB")

    def _end_backlogged(self, stream: RequestStream, flag: str, allowed: str) -> None:
        request_ids = [request_id for request_id, left in stream.unfinished.items() if left > 0]
        log.warning("request %s aborted: its client reads slower than the engine writes, and %.0f MB of its output "
                    "waited (%s)", ", ".join(stream.engines), stream.backlog / 2**20, flag)
        stream.overflow(StreamBacklogFull(
            f"The client read this stream too slowly: {stream.backlog / 2**20:.0f} MB of its output waited in the "
            f"server ({allowed}), so the request was stopped."))
        for request_id in request_ids:
            self.abort(stream, request_id)
            stream.unfinished[request_id] = 0  # aborted here: release has nothing left to abort

    def abort(self, stream: RequestStream, request_id: str, indices: list[int] | None = None) -> None:
        """Stop `request_id` of `stream` in its engine now (only its choices `indices`, when given), while
        the stream stays open for what is on its way; `release` still ends it."""
        engine = stream.engines.get(request_id)
        if request_id in self._streams and engine not in self.down:
            self._send(engine, AbortRequests([request_id], indices))

    async def call_utility(self, engine: int, method: str, *args, timeout: float | None = None):
        if engine in self.down:
            raise EngineDeadError(self.down[engine])
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (engine, future)
        try:
            self._send(engine, UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def mark_down(self, engine: int, reason: str) -> None:
        """Engine `engine` is gone: its requests and calls fail now, and it gets no more."""
        if engine in self.down:
            return
        self.down[engine] = reason
        planned = self.draining.pop(engine, None) is not None  # its node said it was stopping: no failure
        log.log(logging.WARNING if planned else logging.ERROR, "down: %s", reason)
        error = EngineDeadError(reason)
        self._fail_streams(error, engine)
        for owner, future in self._calls.values():
            if owner == engine and not future.done():
                future.set_exception(error)

    def _check_link(self, engine: int) -> None:
        """Whether `engine`'s TCP connection dropped (apiserver/engine_links.py): what it ran may have lost
        outputs."""
        if not self._links.drops(engine) or engine in self.down:
            return
        rank = self.ranks[engine]
        down = self._marks.down_ranks() if self._marks is not None else {}
        if rank in down:  # its node left (or its engine exited) as the connection went: that is why
            self.mark_rank_down(rank, down[rank])
            return
        # No new work there until it answers a ping again (engine_watch clears this): sent now, a request would
        # wait for the link to come back.
        self.set_unanswered(engine, f"the connection to engine core DP{rank} dropped")
        if engine in self.draining or (self._marks is not None and rank in self._marks.draining_ranks()):
            # A drain cut short (--shutdown-timeout, a second signal): not the network.
            why = f"engine core DP{rank}'s node stopped before the request finished"
        else:
            why = (f"the connection to engine core DP{rank} dropped while the request ran (the network to its node "
                   "failed, or the engine stopped answering): outputs of the request may have been lost")
        failed = self.fail_requests_on(engine, why)
        log.log(logging.WARNING if failed else logging.INFO, "the connection to engine core DP%d (%s) dropped; "
                "%d request(s) in flight there failed", rank, self.addresses[engine], failed)

    def fail_requests_on(self, engine: int, reason: str) -> int:
        """`engine`'s requests in flight fail now (503, or an error event in a stream), with `reason`; how many."""
        return self._fail_streams(EngineDeadError(reason), engine)

    def fail_in_flight(self, reason: str) -> None:
        """Every request in flight fails now (503, or an error event in a stream), with `reason`."""
        self._fail_streams(EngineDeadError(reason))

    def _fail_streams(self, error: EngineDeadError, engine: int | None = None) -> int:
        """Fail the requests in flight (on `engine` only, unless None); how many."""
        failed = 0
        for stream in {id(s): s for s in self._streams.values()}.values():  # (one entry per engine request)
            if engine is None or engine in stream.engines.values():
                stream.fail(error)
                failed += 1
        return failed

    def mark_rank_down(self, rank: int, reason: str) -> None:
        engine = self._position.get(rank)
        if engine is not None:
            self.mark_down(engine, f"engine core DP{rank}: {reason}")

    def mark_rank_draining(self, rank: int) -> None:
        engine = self._position.get(rank)
        if engine is not None and engine not in self.down and engine not in self.draining:
            self.draining[engine] = f"engine core DP{rank}: its node is stopping (it finishes its running requests)"
            log.info("draining: %s", self.draining[engine])

    @property
    def draining_reason(self) -> str | None:
        """Why no engine takes new requests, where every one that is not down drains."""
        return self._every_usable(self.draining) if self.draining else None  # (per request: no list made)

    def set_unanswered(self, engine: int, reason: str | None) -> None:
        """engine_watch's verdict on `engine`: why it is not answering pings now, or None once it does."""
        if reason is None:
            self._unanswered.pop(engine, None)
        else:
            self._unanswered[engine] = reason

    @property
    def unanswered_reason(self) -> str | None:
        """Why no engine answers pings now (they may still be alive: /health says 503 meanwhile)."""
        return self._every_usable(self._unanswered)

    def _every_usable(self, marks: dict[int, str]) -> str | None:
        """The first usable engine's reason in `marks`, where every usable engine has one."""
        usable = self.usable()
        if usable and all(e in marks for e in usable):
            return marks[usable[0]]
        return None

    def answering(self, engine: int) -> bool:
        return engine not in self.down and engine not in self._unanswered

    def rank_views(self) -> list[dict]:
        """Every rank as this server sees it: up, answering pings, its last reported load, this server's
        requests there (for /load, /server_info and /metrics)."""
        loads = self.loads
        group = loads.group_in_flight()
        return [
            {
                "rank": rank, "address": self.addresses[i], "up": i not in self.down, "down_reason": self.down.get(i),
                "draining": i in self.draining,
                "answering": self.answering(i), "num_running": loads.running[i], "num_waiting": loads.waiting[i],
                "kv_cache_usage": loads.kv_cache_usage[i], "in_flight_here": loads.in_flight[i],
                "in_flight": group[i] if group is not None else loads.in_flight[i],
            }
            for i, rank in enumerate(self.ranks)
        ]

    # Internals.
    def _least_loaded(self) -> int:
        if len(self._sockets) == 1:
            return 0
        usable = self.usable()
        if self.draining:
            usable = [e for e in usable if e not in self.draining]
        return self.loads.least_loaded(usable, {e for e in usable if e not in self._unanswered})

    def _send(self, engine: int, record) -> None:
        self._send_frames(engine, codec.encode(record))

    def _send_frames(self, engine: int, frames: list[bytes]) -> None:
        # SNDHWM is 0 (no limit): the send never has to wait.
        sock = self._sockets[engine]
        if sock.closed:
            # The server is past its stop (close()): requests its loop cancels on the way out release
            # themselves here, and a send on the closed socket raised out of each, a traceback apiece.
            return
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
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
        change) or the slice is over; then the rest waits for a drain scheduled after what else is ready.
        Last, the streams' handlers get what this drain held for them."""
        self._drain_scheduled[engine] = False
        try:
            self._read(engine)
        finally:
            to_hand = self._to_hand[:]  # (the streams hold this list itself)
            self._to_hand.clear()
            for stream in to_hand:
                stream.hand_over()

    def _read(self, engine: int) -> None:
        sock = self._sockets[engine]
        self._check_link(engine)  # a drop is seen before the outputs that came after it
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
            self.loads.report(engine, record.num_running, record.num_waiting, record.kv_cache_usage)
            streams = self._streams
            for output in record.outputs:
                stream = streams.get(output.request_id)
                if stream is not None and stream.put(output):  # None: released (aborted) while this step ran
                    self._end_for_backlog(stream)
            if self.backlogs.over_total:
                self._end_largest_backlogs()
        elif isinstance(record, UtilityResult):
            call = self._calls.get(record.call_id)
            if call is not None and not call[1].done():
                if record.error is not None:
                    call[1].set_exception(RuntimeError(record.error))
                else:
                    call[1].set_result(record.result)
        elif isinstance(record, EngineDead):
            self.mark_down(engine, f"engine core DP{self.ranks[engine]}: {record.reason}")
