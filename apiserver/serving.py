"""What the generation endpoints share: the model and engine checks, the request id and priority rules, and
running a Generation (apiserver/generation_run.py) to a streamed or a whole response."""
from __future__ import annotations

import asyncio
import os
from typing import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from apiserver.context import ServerContext
from apiserver.engine_errors import EngineDeadError, RequestAborted, UnknownRank
from apiserver.errors import CLIENT_CLOSED_REQUEST, REQUEST_ID_SCOPE_KEY, InvalidRequest, ModelNotFound
from apiserver.generation import Delta, Generation
from apiserver.generation_run import GenerationRun
from apiserver.priority_header import BadPriority, header_priority
from apiserver.protocol import MAX_REQUEST_ID_LENGTH
from apiserver.streaming import ChunkWriter, EventStreamResponse

# A whole body with this many logprob entries (tokens x (1 + top logprobs)) or more is formatted and encoded in a
# worker thread: about 3 us an entry, so the most --max-logprob-entries allows (a million) held the event loop 4.5 s,
# and three such answers at once 8 s, near the heartbeat's timeout. The thread shares the GIL but lets the loop
# run every few milliseconds.
OFFLOAD_LOGPROB_ENTRIES = 20_000

RANK_HEADER = "x-data-parallel-rank"  # vLLM's: pins a request to one data-parallel rank


class GenerationServing:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # Preflight.
    def check_model(self, name: str | None) -> None:
        """None passes: a request that leaves the model out asks for the served one (as vLLM reads it)."""
        if name is not None and name != self.ctx.model_name:
            raise ModelNotFound(name)

    def check_engine(self) -> None:
        reason = self.ctx.engine_dead_reason()
        if reason is not None:
            raise EngineDeadError(reason)

    # Request identity.
    @staticmethod
    def request_id(request: Request, body_request_id: str | None) -> str:
        """X-Request-Id wins over the body's `request_id`; else a new random one. Kept in the scope, where
        --enable-request-id-headers' middleware finds the id to echo."""
        header = request.scope.get(REQUEST_ID_SCOPE_KEY) or request.headers.get("x-request-id")
        if header is not None and len(header) > MAX_REQUEST_ID_LENGTH:
            raise InvalidRequest(f"The X-Request-Id header must be at most {MAX_REQUEST_ID_LENGTH} characters "
                                 f"long, not {len(header)}.", param="x-request-id")
        rid = header or body_request_id or os.urandom(16).hex()
        request.scope[REQUEST_ID_SCOPE_KEY] = rid
        return rid

    @staticmethod
    def priority(request: Request, body_priority: int) -> int:
        """X-Priority (or vLLM's X-Vllm-Priority) overrides the body's `priority` (apiserver/priority_header.py)."""
        try:
            priority = header_priority(lambda name: _one_header_value(request, name))  # (twice, differing: a 400)
        except BadPriority as exc:
            raise InvalidRequest(str(exc), param=exc.name) from None
        return body_priority if priority is None else priority

    def data_parallel_rank(self, request: Request, body_rank: int | None) -> int | None:
        """The rank a router pinned the request to: vLLM's X-data-parallel-rank header, else the body's
        `data_parallel_rank` (what smg sends to a DP-aware worker). A rank this group does not serve is a 400,
        one that is down a 503, both before anything runs."""
        value = _one_header_value(request, RANK_HEADER)
        if value is not None:
            text = value.strip()
            if not (text.isascii() and text.isdigit() and len(text) <= 4):
                raise InvalidRequest(f"The {RANK_HEADER} header must be a rank number, not {_as_sent(value)[:40]!r}.",
                                     param=RANK_HEADER)
            if body_rank is not None and body_rank != int(text):
                raise InvalidRequest(f"The {RANK_HEADER} header ({int(text)}) and the body's data_parallel_rank "
                                     f"({body_rank}) name different ranks.", param=RANK_HEADER)
            body_rank = int(text)
        if body_rank is not None:
            self.ctx.sync_down_ranks()
            try:
                self.ctx.engine.engine_of_rank(body_rank)
            except UnknownRank as exc:
                raise InvalidRequest(f"{exc}.", param=RANK_HEADER if value is not None else "data_parallel_rank",
                                     code="unknown_data_parallel_rank") from None
        return body_rank

    # Running it.
    async def respond(
        self,
        request: Request,
        generation: Generation,
        stream: bool,
        writer: ChunkWriter,
        include_usage: bool,
        whole_body: Callable[[Generation, list[Delta]], dict],
    ):
        """An SSE stream (which runs the generation when it is sent), or one JSON body once every choice
        finished."""
        run = GenerationRun(self.ctx, generation, request.receive)
        if stream:
            return EventStreamResponse(run, writer, include_usage, self.ctx.config.sse_keep_alive_interval)
        try:
            with run:
                while not generation.done:
                    await generation.next_changes()
        except RequestAborted:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is listening; uvicorn drops it
        deltas = generation.take(generation.choices)
        if _logprob_entries(generation, deltas) >= OFFLOAD_LOGPROB_ENTRIES:
            encoded = await asyncio.to_thread(lambda: orjson.dumps(whole_body(generation, deltas)))
        else:
            encoded = orjson.dumps(whole_body(generation, deltas))
        return Response(encoded, media_type="application/json")


def _logprob_entries(generation: Generation, deltas: list[Delta]) -> int:
    """About how many logprob entries the whole body holds: its tokens with logprobs, each with its top ones."""
    sampling = generation.sampling
    top = max(sampling.logprobs or 0, sampling.prompt_logprobs or 0)
    tokens = sum(len(d.logprobs or ()) + len(d.prompt_logprobs or ()) for d in deltas)
    return tokens * (1 + top)


def _one_header_value(request: Request, name: str) -> str | None:
    """The header's value; a 400 when it comes more than once with different values (which one a proxy or this
    server would honour is anybody's guess, so neither is)."""
    values = set(request.headers.getlist(name))
    if len(values) > 1:
        shown = ", ".join(sorted(repr(_as_sent(value)[:40]) for value in values))
        raise InvalidRequest(f"The {name} header came more than once, with different values: {shown}.", param=name)
    return values.pop() if values else None


def _as_sent(value: str) -> str:
    """A header value as its client most likely wrote it: HTTP hands over bytes, which the ASGI server decodes as
    Latin-1, so a UTF-8 client's '１' (a full-width digit) would show as three odd characters in an error."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value
