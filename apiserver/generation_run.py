"""One generation from admission to its record, the same for streamed and whole answers:

    with GenerationRun(ctx, generation, receive) as generation:  # admit, start in the engine, watch the client
        ... await generation.next_changes() ...
    # whatever ended it (done, an error, the client gone, a cancellation), exactly once: stop watching, close
    # the engine stream (the engine aborts what still runs), release the admission, record the metrics.

A whole answer runs it in its route; a streamed one in its response (apiserver/streaming.py), so that an
admission 503 is still raised before any byte, to the app's exception handlers, and nothing is ever admitted
for a response that is never sent.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from apiserver.context import ServerContext
from apiserver.errors import InvalidRequest, Overloaded
from apiserver.generation import Generation


def watch_disconnect(receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A client disconnect shows up only as an `http.disconnect` from `receive` (uvicorn silently drops
    writes to a closed connection): this task waits for it, and aborts the generation."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.ensure_future(watch())


class GenerationRun:
    __slots__ = ("_ctx", "_generation", "_receive", "_watcher", "_admitted")

    def __init__(self, ctx: ServerContext, generation: Generation, receive):
        self._ctx = ctx
        self._generation = generation
        self._receive = receive
        self._watcher: asyncio.Task | None = None
        self._admitted = False

    def __enter__(self) -> Generation:
        ctx, generation = self._ctx, self._generation
        tokens = generation.num_prompt_tokens
        limit = ctx.config.max_num_queued_tokens
        if limit is not None and tokens > limit:
            raise InvalidRequest(  # a 503 would tell the client to retry what can never be admitted
                f"The request has {tokens} prompt tokens, more than this server ever admits at once ({limit}, "
                f"--max-num-queued-tokens).", code="too_many_tokens",
            )
        try:
            ctx.admission.admit(tokens)
        except Overloaded:
            ctx.metrics.count_rejected()
            raise
        try:
            generation.start()
        except BaseException:
            ctx.admission.release(tokens)
            raise
        self._admitted = True
        ctx.metrics.count_routed(generation.ranks)
        if ctx.config.enable_server_load_tracking:
            ctx.server_load += 1
        self._watcher = watch_disconnect(self._receive, generation.abort)
        return generation

    def __exit__(self, *exc_info) -> None:
        if not self._admitted:
            return
        self._admitted = False
        ctx, generation = self._ctx, self._generation
        unfinished = generation.unfinished_reason  # (before close, which lets go of the stream that says it)
        try:
            self._watcher.cancel()
            generation.close()
        finally:
            ctx.admission.release(generation.num_prompt_tokens)
            if ctx.config.enable_server_load_tracking:
                ctx.server_load -= 1
            first = generation.first_output_at
            ctx.metrics.finished(
                [c.finish_reason or unfinished for c in generation.choices],
                generation.num_prompt_tokens,
                generation.num_completion_tokens,
                time.monotonic() - generation.arrival,
                None if first is None else first - generation.arrival,
            )
