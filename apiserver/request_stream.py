"""One API request's stream of engine outputs, filled by the engine client's reader, read by one consumer.

Each request gets a RequestStream (a list plus a future, lighter than an asyncio.Queue) that the reader fills
with the request's RequestOutputs as they arrive, one batch per engine step. A streamed response may hand it a
handler that takes a drain's outputs without waking its task (apiserver/streaming.py); a consumer that does not
keep up has its backlog counted against --max-stream-backlog-mb.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from apiserver.engine_errors import RequestAborted

log = logging.getLogger(__name__)

# What a decoded RequestOutput holds in memory, in bytes (tracemalloc over a decoded OUTPUTS message of 1,000
# one-token outputs: 564 bare, 778 with logprobs, 2,856 with 20 top logprobs): a backlog's size as estimated.
_OUTPUT_BYTES = 560
_LOGPROB_BYTES = 215  # a token's logprob entry
_TOP_BYTES = 104  # each of its top logprobs


def output_bytes(output) -> int:
    """About what `output` holds in memory, prompt logprobs included."""
    size = _OUTPUT_BYTES
    for entries in (output.logprobs, output.prompt_logprobs):
        if entries:
            last = entries[-1]
            top = len(last[1]) if last and last[1] else 0
            size += len(entries) * (_LOGPROB_BYTES + _TOP_BYTES * top)
    return size


class Backlogs:
    """The limits on outputs that wait for their consumers, and what waits in all the streams of one engine client
    (bytes as output_bytes estimates them): past `stream_limit` one stream is ended, past `total_limit` the one
    that holds most (0: no such limit)."""

    __slots__ = ("stream_limit", "total_limit", "total")

    def __init__(self, stream_limit: int = 0, total_limit: int = 0):
        self.stream_limit = stream_limit
        self.total_limit = total_limit
        self.total = 0

    @property
    def counted(self) -> bool:
        return bool(self.stream_limit or self.total_limit)

    @property
    def over_total(self) -> bool:
        return self.total_limit > 0 and self.total > self.total_limit


class RequestStream:
    """The outputs of one API request's engine requests (one per prompt), in arrival order, for one consumer.

    A consumer may set a `handler`: while it waits in `next_batch` with nothing pending, the outputs that end
    no sequence are held instead of waking it, and once the reader has read what the engines sent (its drain
    ends), `handler(outputs)` gets them all at once; only what it declines (returns False) wakes the consumer.
    Since the handler runs only while the consumer waits, everything before has been consumed: the order of
    what both do holds. The outputs of one drain go together, so a server that falls behind hands out several
    steps' tokens in one event, as a woken consumer would take them. A streamed response writes its events so
    (apiserver/streaming.py), with no task to wake per token.

    The outputs not taken yet are the stream's backlog: a consumer that waits on a slow client (a transport paused,
    gRPC's flow control) takes none meanwhile, and the engine goes on writing. Past its `backlogs`' limit for one
    stream (bytes as output_bytes estimates them) `put` says so, and the reader ends the stream (`overflow`); each
    stream's backlog counts in the backlogs' total too, which the reader keeps under its own limit."""

    __slots__ = ("engines", "unfinished", "handler", "backlog", "_items", "_waiter", "_error", "_loop",
                 "_handled_at", "_held", "_to_hand", "_backlogs", "_overflowed")

    def __init__(self, engines: dict[str, int], num_sequences: int, loop: asyncio.AbstractEventLoop,
                 to_hand: list | None = None, backlogs: Backlogs | None = None):
        """`to_hand`: the reader's list of streams whose held outputs go to their handler when its drain ends;
        `backlogs`: the limits on outputs not taken yet, and their total over the reader's streams."""
        self.engines = engines  # engine request id -> the engine that runs it
        self.unfinished = dict.fromkeys(engines, num_sequences)  # engine request id -> sequences still running
        self.handler: Callable[[list], bool] | None = None
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._loop = loop
        self._handled_at = 0.0  # loop time of the last outputs the handler took
        self._held = False  # outputs wait in _items for the handler (this stream is in _to_hand)
        self._to_hand = to_hand
        self._backlogs = backlogs if backlogs is not None and backlogs.counted else None
        self.backlog = 0  # bytes of the outputs in _items, as estimated (only with a limit)
        self._overflowed = False

    def put(self, output) -> bool:
        """Queue `output`; True when that took the backlog past its limit (the reader then ends the stream)."""
        backlogs = self._backlogs
        if backlogs is not None:
            if self._overflowed:
                return False  # ended: what its engines still send goes nowhere
            size = output_bytes(output)
            self.backlog += size
            backlogs.total += size
        self._items.append(output)
        if output.finish_reason is not None:
            self.unfinished[output.request_id] -= 1
        elif self.handler is not None and self._to_hand is not None:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                if not self._held:
                    self._held = True
                    self._to_hand.append(self)
                return False
        self._wake()
        return backlogs is not None and 0 < backlogs.stream_limit < self.backlog

    def overflow(self, error: BaseException) -> None:
        """End the stream for its backlog: the outputs go, the consumer meets `error` at its next batch."""
        self._items = []
        self.drop_backlog()
        self._overflowed = True
        self.fail(error)

    def drop_backlog(self) -> None:
        """The outputs not taken yet no longer count (taken, dropped, or their consumer gone)."""
        if self._backlogs is not None:
            self._backlogs.total -= self.backlog
        self.backlog = 0

    def hand_over(self) -> None:
        """The held outputs to the handler, if the consumer still waits for them (else it takes them)."""
        self._held = False
        waiter, handler = self._waiter, self.handler
        if waiter is None or waiter.done() or not self._items:
            return
        items, self._items = self._items, []
        taken = False
        if handler is not None:
            try:
                taken = handler(items)
            except Exception:  # the consumer then meets the outputs itself (its own error, if they fail there too)
                log.exception("a stream's output handler failed")
        if taken:
            self._handled_at = self._loop.time()
            self.drop_backlog()
        else:
            self._items = items
            self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    @property
    def ended_by_the_server(self) -> bool:
        """Whether it failed for the server's reasons (an engine gone, the stop's deadline, its backlog), not
        because its client went away or asked to stop it: /metrics counts such a request's unfinished choices
        as `error`, not `abort`."""
        return self._error is not None and not isinstance(self._error, RequestAborted)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self, timeout: float | None = None) -> list:
        """Every output that arrived since the last call; waits while there is none. [] after `timeout`
        seconds in which neither an output came nor the handler took one (its keep-alive is silence)."""
        started = self._loop.time() if timeout is not None else 0.0
        wait = timeout
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            timer = self._loop.call_later(wait, self._wake) if wait is not None else None
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if timeout is not None and not self._items and self._error is None:
                wait = max(started, self._handled_at) + timeout - self._loop.time()
                if wait <= 0:
                    return []
        items, self._items = self._items, []
        self.drop_backlog()
        return items
