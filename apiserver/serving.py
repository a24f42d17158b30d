"""What the generation endpoints share: the model and engine checks, the request id and priority rules,
admission, and running a Generation to a streamed or a whole response."""
from __future__ import annotations

import os
import time
from typing import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from apiserver.context import ServerContext
from apiserver.engine_client import EngineDeadError, RequestAborted
from apiserver.errors import EngineDead, ModelNotFound, Overloaded
from apiserver.generation import Generation
from apiserver.streaming import ChunkWriter, EventStreamResponse, stream_events, watch_disconnect

REQUEST_ID_SCOPE_KEY = "supervise.request_id"  # set by the request-id middleware when it made or read one
_PRIORITY_HEADERS = ("x-priority", "x-vllm-priority")


class GenerationServing:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # Preflight.
    def check_model(self, name: str | None) -> None:
        """None passes: only the tokenizer endpoints let a client leave the model out."""
        if name is not None and name != self.ctx.model_name:
            raise ModelNotFound(name)

    def check_engine(self) -> None:
        reason = self.ctx.engine_dead_reason()
        if reason is not None:
            raise EngineDead(f"The engine is not available: {reason}")

    # Request identity.
    @staticmethod
    def request_id(request: Request, body_request_id: str | None) -> str:
        """X-Request-Id wins over the body's `request_id`; else a new random one."""
        rid = request.scope.get(REQUEST_ID_SCOPE_KEY) or request.headers.get("x-request-id") or body_request_id
        return rid or os.urandom(16).hex()

    @staticmethod
    def priority(request: Request, body_priority: int) -> int:
        """X-Priority (or vLLM's X-Vllm-Priority) overrides the body's `priority` when it is an integer."""
        headers = request.headers
        for name in _PRIORITY_HEADERS:
            value = headers.get(name)
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    pass
        return body_priority

    # Running it.
    async def respond(
        self,
        request: Request,
        generation: Generation,
        stream: bool,
        writer: ChunkWriter,
        include_usage: bool,
        whole_body: Callable[[Generation], dict],
    ):
        """Admit, start, and answer: an SSE stream, or one JSON body once every choice finished."""
        ctx = self.ctx
        try:
            ctx.admission.admit(generation.num_prompt_tokens)
        except Overloaded:
            ctx.metrics.count_rejected()
            raise
        try:
            generation.start()
        except EngineDeadError as exc:
            ctx.admission.release(generation.num_prompt_tokens)
            raise EngineDead(f"The engine is not available: {exc}") from None
        if ctx.config.enable_server_load_tracking:
            ctx.server_load += 1
        if stream:
            events = stream_events(
                generation, writer, include_usage, ctx.config.sse_keep_alive_interval, lambda: self._finished(generation)
            )
            return EventStreamResponse(events, generation.abort)
        watcher = watch_disconnect(request.receive, generation.abort)
        try:
            while not generation.done:
                await generation.next_changes()
        except EngineDeadError as exc:
            raise EngineDead(f"The engine is not available: {exc}") from None
        except RequestAborted:
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        finally:
            watcher.cancel()
            generation.close()
            self._finished(generation)
        return Response(orjson.dumps(whole_body(generation)), media_type="application/json")

    def _finished(self, generation: Generation) -> None:
        ctx = self.ctx
        ctx.admission.release(generation.num_prompt_tokens)
        if ctx.config.enable_server_load_tracking:
            ctx.server_load -= 1
        now = time.monotonic()
        first = generation.first_output_at
        ctx.metrics.finished(
            [c.finish_reason or "abort" for c in generation.choices],
            generation.num_prompt_tokens,
            generation.num_completion_tokens,
            now - generation.arrival,
            None if first is None else first - generation.arrival,
        )
