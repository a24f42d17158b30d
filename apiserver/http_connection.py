"""One HTTP connection: uvicorn's httptools protocol, plus the read timeouts it lacks and the drain's answer.

uvicorn closes a connection left idle after a response (--timeout-keep-alive, its own timer), but holds
forever a connection that never sends a request and a request whose headers or body never complete
(slowloris). So each connection gets one timer of ours, armed when it is made and re-armed only when it
fires: the fast path (a whole request in one read) pays a clock read and a few attribute writes, never a
timer per request. When it fires it looks at what the connection is doing:
- no request yet, for --timeout-keep-alive: closed without a word, as uvicorn closes an idle keep-alive;
- headers not complete --timeout-request-header after the request's first byte: 408, then closed, as
  nginx's client_header_timeout (a total for the header, so trickling bytes does not extend it);
- the body silent for --timeout-request-header: 408, then closed, as nginx's client_body_timeout (the time
  between two reads, so a large body on a slow link is not cut). While we stopped reading ourselves (the
  app has not taken the body yet) the client is not waiting on us: that time does not count.
A 408 goes out only where no response has started; otherwise the connection just closes.

A request that uvicorn's parser (httptools) refuses (two Content-Lengths, Content-Length with chunked, a bad
chunk size, an unknown method, a header line or URL malformed, TLS or HTTP/2 bytes) gets a 400,
then the connection closes: uvicorn's own answer is plain text. Where such bytes follow requests already read on
the connection (pipelined, or a stray byte after a body whose Content-Length was one short), those requests are
answered first, then the 400, as nginx does (RFC 9112 9.3): before, the connection closed at once, and the answer
of the request in flight was lost with it. Both it and the 408 are `ConnectionAnswer`s:
the OpenAI error body with `Connection: close`, counted in /metrics like the app's answers (README: "counts
every answer by status class, whoever made it"), except where the app already runs the request: then it
reads a disconnect, and its own answer is the one counted.

A request's URL and header lines past --max-request-header-bytes get 431, counted as they come: header by
header, and read by read while the head is incomplete (the parser joins a long line's pieces by copying).

An answer made while the request's body is still coming (a 413, the drain's 503) closes the connection the way
nginx does, lingering: apiserver/lingering_close.py.

While the group stops, requests that arrive on open keep-alive connections get 503 with `Connection: close`
and the OpenAI error body (ConnectionPolicy.refusing), counted in /metrics too: the group will not finish new
work, so the client retries elsewhere at once. Requests already in flight finish.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from apiserver.direct_body import DIRECT_BODY, DirectBody
from apiserver.idle_close import close_idle
from apiserver.ignored_upgrade import head_without_upgrade, new_parser
from apiserver.errors import ApiError, InvalidRequest, RequestTimeout, ShuttingDown, error_body
from apiserver.lingering_close import LINGER_IDLE_SECONDS, LINGER_SECONDS, DiscardingParser, LingeringClose
from apiserver.write_batch import BatchedTransport, WriteBatch

# A header line's bytes besides its name and value: ": " and CRLF.
HEADER_LINE_FRAMING = 4
# While we stopped reading a body (flow control), the body's timer is checked this often: once reading
# resumes, the client gets its full timeout give or take this much.
PAUSED_READ_RECHECK_SECONDS = 1.0


@dataclass
class ConnectionPolicy:
    """What every connection of this server follows; `refusing` turns on when the group starts stopping."""

    timeout_keep_alive: float
    timeout_request_header: float
    refusing: bool = False
    write_batch: WriteBatch | None = None  # this loop's batch of writes (apiserver/write_batch.py); None: direct
    direct_body: bool = False  # each request gets its DirectBody (apiserver/direct_body.py) in its scope
    count_status: Callable[[int], None] | None = None  # Metrics.count_status: answers made here are counted
    # The most bytes of URL and header lines one request may send (--max-request-header-bytes): httptools has no
    # limit, and 8 MB of headers (600,000 of them) were read, kept and answered, 40 MB of the server each.
    max_header_bytes: int = 64 * 1024


class ConnectionAnswer(NamedTuple):
    """An answer the connection makes itself, not the app, always followed by the connection's close."""

    status: int
    raw: bytes  # the whole response: status line, headers, the OpenAI error body

    @classmethod
    def of(cls, error: ApiError, reason: bytes) -> "ConnectionAnswer":
        body = orjson.dumps(error_body(error))
        return cls(error.status, b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                   b"connection: close\r\n\r\n%s" % (error.status, reason, len(body), body))


REQUEST_TIMEOUT = ConnectionAnswer.of(
    RequestTimeout("The request was not received in time: the connection is closed."), b"Request Timeout"
)
INVALID_HTTP = ConnectionAnswer.of(InvalidRequest(
    "The request is not valid HTTP/1.1 (the server could not parse it): the connection is closed.",
    code="invalid_http_request",
), b"Bad Request")
_SHUTTING_DOWN_BODY = orjson.dumps(error_body(ShuttingDown(
    "The server is shutting down and takes no new requests: retry the request.", code="shutting_down"
)))


async def shutting_down_app(scope, receive, send) -> None:
    """The ASGI app of a request that arrives while the group stops."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_SHUTTING_DOWN_BODY)).encode()),
        (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": _SHUTTING_DOWN_BODY})


class HttpConnection(HttpToolsProtocol):
    def __init__(self, config, server_state, app_state, policy: ConnectionPolicy):
        super().__init__(config=config, server_state=server_state, app_state=app_state)
        self._policy = policy
        self._timer = None
        self._made_at = 0.0
        self._reading_since: float | None = None  # loop time of the first byte of the request being read
        self._last_read = 0.0  # loop time of the last piece of the request's body (or its first byte)
        self._headers_done = False
        self._lingering_close = LingeringClose(self)  # the cycle's transport while a request's body is read
        self._linger_until: float | None = None  # loop time by which a lingering close ends
        self._header_bytes = 0  # of the request being read: its URL and header lines, as the parser hands them over
        self._reads_without_body = 0  # bytes read since the request began (after its first read) or since its last body bytes
        self._upgrade_asked = False  # the request being read asks to switch protocols (ignored_upgrade.py)
        self._last_answer: ConnectionAnswer | None = None  # ours, once the requests read before it are answered
        self._tls = False

    # Connection.
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._tls = transport.get_extra_info("ssl_object") is not None
        if self._policy.write_batch is not None:
            self.transport = BatchedTransport(transport, self._policy.write_batch)
        self._made_at = self.loop.time()
        self._timer = self.loop.call_later(self._policy.timeout_keep_alive, self._check_timeouts)

    def eof_received(self) -> None:
        """The client closed its side (or half-closed it after its request: `nc -N`, Go's CloseWrite). uvicorn
        keeps no half-open connection: on return the transport closes itself, past the batching wrapper, and
        drops what is written after. An answer made since the last pass waits in the batch: it goes first, as
        it would have unbatched. (A request still waiting on the engine reads a disconnect, as in uvicorn.)"""
        if isinstance(self.transport, BatchedTransport):
            self.transport.flush()
        return super().eof_received()

    def shutdown(self) -> None:
        """uvicorn's, with an idle connection closed by close_idle."""
        if self.cycle is None or self.cycle.response_complete:
            self._close_idle()
        else:
            self.cycle.keep_alive = False

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's timer after a response, with the connection closed by close_idle."""
        self._close_idle()

    def _close_idle(self) -> None:
        if isinstance(self.transport, BatchedTransport):
            self.transport.flush()  # an answer still in the batch is sent, not dropped by an abort
        close_idle(self.transport, self._tls)

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """httptools hands over a header only when its line is complete, joining the pieces of one long header
        (`bytes +=`) until then, and uvicorn joins the URL's pieces the same way: a 64 MB header value sent in
        64 KB pieces was 14.8 s of copying in this process, its /health late by up to 3.5 s, 167 MB held; a
        chunked body's trailer without end, 293 MB and /health unanswered for 5 s. So the reads of a request that
        bring none of its body (its head, a trailer, chunk framing) are counted before the parser has them: past
        the limit, 431 at once (one read past it at most reaches the parser). The read where the request began
        is not counted: a head that fits in one read is counted exactly, header by header, below."""
        if self._reading_since is not None and self._linger_until is None:
            if self._reads_without_body > self._policy.max_header_bytes:
                self._answer_and_close(_headers_too_large(self._policy.max_header_bytes), linger=True)
                return
            self._reads_without_body += len(data)  # (on_body starts the count again)
        # uvicorn's own data_received, but for an upgrade (apiserver/ignored_upgrade.py), and the keep-alive timer
        # stopped by a request's first byte (on_message_begin), not by any read: the parser skips bare CRLFs
        # between requests, and two bytes every few seconds held an idle connection open for ever.
        # What the parser is to read, in order (views: a pipelined rest is not copied).
        pieces: list[bytes | memoryview] = [memoryview(data)]
        while pieces:
            piece = pieces.pop(0)
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            except httptools.HttpParserUpgrade as upgrade:
                # A loop, not a nested call per request: thousands of them pipelined in one read are one read.
                pieces = [self._head_without_upgrade(), piece[upgrade.args[0]:]]

    def _head_without_upgrade(self) -> bytes:
        """The parser stopped after a request that asks for an upgrade (on_headers_complete held it back): the
        same request's head, asking for none, for a new parser, which then reads what followed it."""
        self._upgrade_asked = False
        head = head_without_upgrade(self.parser.get_method(), self.url, self.parser.get_http_version(), self.headers)
        self.parser = new_parser(self)
        return head

    # Parser callbacks: where a request's reading starts, progresses and ends.
    def on_message_begin(self) -> None:
        self._unset_keepalive_if_required()
        super().on_message_begin()
        self._reading_since = self._last_read = self.loop.time()
        self._headers_done = False
        self._header_bytes = self._reads_without_body = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + HEADER_LINE_FRAMING)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self._policy.max_header_bytes:
            raise _HeadersTooLarge  # stops the parser: data_received answers (send_400_response)

    def on_headers_complete(self) -> None:
        if self.parser.should_upgrade():
            if self.parser.get_method() == b"CONNECT":
                raise _NotAProxy  # a tunnel's bytes would follow: 400, closed
            self._upgrade_asked = True  # held back: the parser ends the message here, body unread
            return
        self._headers_done = True
        if self._policy.refusing:
            self.app = shutting_down_app  # this connection closes after the answer
            if self._policy.count_status is not None:  # (the app's status counter never sees this answer)
                self._policy.count_status(503)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (not an upgrade)
            if self._policy.direct_body:
                cast(dict, self.scope)[DIRECT_BODY] = DirectBody(cycle, self.flow)  # a key of ours: not in ASGI's type
            cycle.transport = self._lingering_close  # until the body is in (on_message_complete)

    def on_body(self, body: bytes) -> None:
        self._last_read = self.loop.time()
        self._reads_without_body = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._upgrade_asked:
            return  # the parser's end of a message it did not read: it is parsed again (_head_without_upgrade)
        self._reading_since = None
        cycle = self.cycle
        if cycle is not None and cycle.transport is self._lingering_close:
            cycle.transport = self.transport
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn resumes reading after every response, with pipelined requests still queued: a client that sends
        # requests without reading the answers had them parsed and queued without end (600,000 GET /health in
        # 20 s: 1.3 GB). Reading waits until the queue is empty; what one read brings is parsed, no more.
        if self.pipeline:
            self.flow.pause_reading()
        elif self._last_answer is not None and (self.cycle is None or self.cycle.response_complete):
            answer, self._last_answer = self._last_answer, None
            self._write_answer(answer, counted=True)
            self._unset_keepalive_if_required()  # (uvicorn's idle timer, just armed: the linger ends the connection)
            self.linger()  # what the client sent after its requests was read and dropped: it may still send

    # The lingering close (apiserver/lingering_close.py).
    def linger(self) -> None:
        """Close, with the request's body still coming: the answer and a FIN now, the socket later."""
        if self._linger_until is not None:
            return
        now = self.loop.time()
        self._linger_until = now + LINGER_SECONDS
        self._last_read = now
        self.parser = DiscardingParser(self._read_while_lingering)
        cycle = self.cycle
        if cycle is not None:  # this connection serves no further request: no keep-alive timer, nothing pipelined
            cycle.on_response = _nothing
            cycle.body = bytearray()
        self.flow.resume_reading()
        if self.transport.can_write_eof():  # not over TLS, whose close_notify comes with the close
            self.transport.write_eof()  # after what is written: the client reads the answer, then EOF
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(LINGER_IDLE_SECONDS, self._check_timeouts)

    def _read_while_lingering(self) -> None:
        self._last_read = self.loop.time()

    # The timer.
    def _check_timeouts(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._linger_until is not None:
            left = min(self._last_read + LINGER_IDLE_SECONDS, self._linger_until) - now
            if left <= 0:
                self.transport.close()
            else:
                self._timer = self.loop.call_later(left, self._check_timeouts)
            return
        timeout = self._policy.timeout_request_header
        if self._reading_since is not None:
            if not self._headers_done:
                left = self._reading_since + timeout - now
            elif self.flow.read_paused:
                self._last_read = now
                left = PAUSED_READ_RECHECK_SECONDS
            else:
                left = self._last_read + timeout - now
            if left <= 0:
                self._time_out_request()
                return
        elif self.scope is None:  # not a byte of a request yet
            left = self._made_at + self._policy.timeout_keep_alive - now
            if left <= 0:
                self._close_idle()
                return
        else:
            left = timeout  # a request is being served, or uvicorn's keep-alive timer watches the idle time
        self._timer = self.loop.call_later(left, self._check_timeouts)

    def _time_out_request(self) -> None:
        self._answer_and_close(REQUEST_TIMEOUT)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused (it has logged a warning): ours instead."""
        too_large = self._header_bytes > self._policy.max_header_bytes
        self._answer_and_close(_headers_too_large(self._policy.max_header_bytes) if too_large else INVALID_HTTP)

    def _answer_and_close(self, answer: ConnectionAnswer, linger: bool = False) -> None:
        """Answer the request being read, where nothing else has answered it, then close the connection;
        `linger`: the request is still coming, so the close lingers (the client reads the answer, not a reset)."""
        cycle = self.cycle
        # The app runs this request and waits for its body (its headers are complete and uvicorn made its
        # cycle: not when the parser refused the URL at the end of the headers).
        app_runs = self._reading_since is not None and cycle is not None and cycle.scope is self.scope
        if app_runs:
            answerable = not cycle.response_started
            cycle.disconnected = True  # what it sends now goes nowhere; it reads a disconnect
            cycle.message_event.set()
        elif cycle is not None and not cycle.response_complete:
            # The app never saw this request, and requests read before it are not all answered yet: they are
            # answered first (on_response_complete then makes this answer), and nothing more is parsed.
            self._last_answer = answer
            self._reading_since = None
            self.parser = DiscardingParser(_nothing)
            return
        else:
            answerable = True
        if answerable:
            self._write_answer(answer, counted=not app_runs)  # (where the app runs it, its answer is counted)
        if linger:
            self.linger()
        else:
            self.transport.close()

    def _write_answer(self, answer: ConnectionAnswer, counted: bool) -> None:
        if counted and self._policy.count_status is not None:
            self._policy.count_status(answer.status)
        self.transport.write(answer.raw)


def _nothing() -> None:
    pass


def _headers_too_large(limit: int) -> ConnectionAnswer:
    return ConnectionAnswer.of(InvalidRequest(
        f"The request's URL and headers are larger than {limit:,} bytes in all (--max-request-header-bytes): the "
        f"connection is closed.", code="request_headers_too_large", status=431,
    ), b"Request Header Fields Too Large")


class _NotAProxy(Exception):
    """Raised from a parser callback for CONNECT: this server opens no tunnels (400, as httptools' errors)."""


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools stops and raises HttpParserCallbackError, an HttpParserError."""
