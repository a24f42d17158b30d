"""Server-sent events for streamed completions.

The response is a bare ASGI callable rather than Starlette's StreamingResponse: each event is bytes built by
the endpoint's chunk writer, sent as it is, with no per-chunk encoding and no anyio task group per request.
It runs the generation (apiserver/generation_run.py) itself: admission and the engine start happen when it is
called, so a 503 is raised to the app's exception handlers before any byte. Status 200 goes out next; an error
after that becomes an error event. The writer says how a stream ends: chat and completions with `data: [DONE]`,
the Responses API with its `response.completed` event.

Where the connection offers its body directly (apiserver/direct_body.py, --direct-stream-events), the events
between the head and the last go straight to it, and while the response waits for outputs, the engine
client's reader writes their events itself (`push_events`): a streamed token then costs no task wake-up, no
async generator step and no ASGI send chain. What ends the stream, an error, a keep-alive comment, a client
that reads slower than we write, and requests with stop strings (their text may end a choice at any token)
take the response's own path, the same events in the same order.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Protocol

import orjson

from apiserver.direct_body import DIRECT_BODY, DirectBody
from apiserver.engine_errors import RequestAborted
from apiserver.errors import as_api_error, error_body, is_expected, log_server_error
from apiserver.generation import Delta, Generation
from apiserver.generation_run import GenerationRun

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell reverse proxies not to buffer the stream
]


class ChunkWriter(Protocol):
    """What an endpoint provides to stream its own chunk format. It formats; it never changes the choices."""

    def first(self, generation: Generation) -> bytes: ...

    def changes(self, deltas: list[Delta]) -> bytes: ...

    def usage(self, generation: Generation) -> bytes: ...

    def end(self, generation: Generation) -> bytes:
        """What closes a stream that finished (after the last changes and the usage)."""
        ...

    def error(self, error) -> bytes:
        """What closes a stream that failed: the error (an ApiError) as an event."""
        ...


class EventStreamResponse:
    status_code = 200

    def __init__(self, run: GenerationRun, writer: ChunkWriter, include_usage: bool, keep_alive: float | None):
        self._run = run
        self._writer = writer
        self._include_usage = include_usage
        self._keep_alive = keep_alive

    async def __call__(self, scope, receive, send) -> None:
        body = scope.get(DIRECT_BODY)  # None: every event through `send`
        with self._run as generation:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if body is not None and generation.pushable:
                generation.push_to(push_events(generation, self._writer, body))
            events = stream_events(generation, self._writer, self._include_usage, self._keep_alive)
            try:
                async for event, last in events:
                    # The last event goes out in the same write as the end of the body.
                    if last:
                        await send({"type": "http.response.body", "body": event, "more_body": False})
                        break
                    if body is not None and body.writable():
                        body.write(event)
                    else:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
            finally:
                await events.aclose()


def push_events(generation: Generation, writer: ChunkWriter, body: DirectBody):
    """The handler of a waiting response's outputs (Generation.push_to): the event of the outputs one drain of
    the engine client's reader brought, formatted and written on the reader's call stack. It declines while the
    body is not writable (the response's task then writes it, after waiting out the client); it never raises
    into the reader, which serves every other stream too: a failure is raised in the response's task instead,
    as its error event."""

    def push(outputs: list) -> bool:
        if not body.writable():
            return False
        try:
            event = writer.changes(generation.take(generation.apply(outputs)))
        except Exception as exc:
            generation.fail(exc)
            return True
        if event:
            body.write(event)
        return True

    return push


async def stream_events(
    generation: Generation, writer: ChunkWriter, include_usage: bool, keep_alive: float | None
) -> AsyncIterator[tuple[bytes, bool]]:
    """(events, whether they are the last) of one streamed generation, from its first chunk to the writer's end,
    which always comes in the same write as the last chunk (one write instead of three at the end of every
    stream)."""
    try:
        first = writer.first(generation)
        if first:
            yield first, False
        while True:
            changed = await generation.next_changes(keep_alive)
            if generation.done:
                usage = writer.usage(generation) if include_usage else b""
                tail = writer.changes(generation.take(changed)) + usage + writer.end(generation)
                break
            if changed:
                chunk = writer.changes(generation.take(changed))
                if chunk:  # empty while text is held back (a partial character, a possible stop string)
                    yield chunk, False
            else:
                yield KEEP_ALIVE, False
    except RequestAborted:
        return  # the client is gone: nobody to tell
    except Exception as exc:
        if not is_expected(exc):
            log.error("unexpected error while streaming a response", exc_info=exc)
        error = as_api_error(exc)
        log_server_error(error, exc, getattr(exc, "request_id", None) or generation.request_id, "stream")
        tail = writer.error(error)
    yield tail, True


def error_event(error) -> bytes:
    return b"data: " + orjson.dumps(error_body(error)) + b"\n\n"
