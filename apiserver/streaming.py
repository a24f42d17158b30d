"""Server-sent events for streamed completions, and noticing a client that went away.

The response is a bare ASGI callable rather than Starlette's StreamingResponse: each event is bytes built by
the endpoint's chunk writer, sent as it is, with no per-chunk encoding and no anyio task group per request.
Status 200 goes out with the first bytes; an error after that becomes a `data:` error event, and
`data: [DONE]` always ends the stream.

A client disconnect shows up only as an `http.disconnect` from `receive` (uvicorn silently drops writes to a
closed connection), so a small watcher task waits for it and aborts the generation, which the engine hears
within a step.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Protocol

import orjson

from apiserver.engine_client import EngineDeadError, RequestAborted
from apiserver.errors import EngineDead, as_api_error, error_body
from apiserver.generation import Choice, Generation

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell reverse proxies not to buffer the stream
]


class ChunkWriter(Protocol):
    """What an endpoint provides to stream its own chunk format."""

    def first(self, generation: Generation) -> bytes: ...

    def changes(self, generation: Generation, changed: list[Choice]) -> bytes: ...

    def usage(self, generation: Generation) -> bytes: ...


def watch_disconnect(receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.ensure_future(watch())


class EventStreamResponse:
    status_code = 200

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None], headers: list | None = None):
        self._events = events
        self._on_disconnect = on_disconnect
        self._headers = _SSE_HEADERS + (headers or [])

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        watcher = watch_disconnect(receive, self._on_disconnect)
        try:
            async for event in self._events:
                # The last event ends with [DONE]: it goes out in the same write as the end of the body.
                last = event.endswith(DONE)
                await send({"type": "http.response.body", "body": event, "more_body": not last})
                if last:
                    break
        finally:
            watcher.cancel()
            await self._events.aclose()


async def stream_events(
    generation: Generation, writer: ChunkWriter, include_usage: bool, keep_alive: float | None, on_close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The events of one streamed generation, from its first chunk to `data: [DONE]`, which always comes
    in the same event as the last chunk (one write instead of three at the end of every stream)."""
    tail = DONE
    try:
        first = writer.first(generation)
        if first:
            yield first
        while True:
            changed = await generation.next_changes(keep_alive)
            if generation.done:
                tail = writer.changes(generation, changed) + (writer.usage(generation) if include_usage else b"") + DONE
                break
            if changed:
                chunk = writer.changes(generation, changed)
                if chunk:  # empty while text is held back (a partial character, a possible stop string)
                    yield chunk
            else:
                yield KEEP_ALIVE
    except RequestAborted:
        return  # the client is gone: nobody to tell
    except EngineDeadError as exc:
        tail = error_event(EngineDead(f"The engine is not available: {exc}")) + DONE
    except Exception as exc:
        tail = error_event(as_api_error(exc)) + DONE
    finally:
        generation.close()
        on_close()
    yield tail


def error_event(error) -> bytes:
    return b"data: " + orjson.dumps(error_body(error)) + b"\n\n"
