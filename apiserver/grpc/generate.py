"""One Generate call, from a parsed request to the responses it streams: admission, the engine request, and
whatever ends it (every sample finished, an Abort, the client cancelling, the engine dying).

A client that cancels its call (or goes away) cancels the handler's task: the `finally` releases the engine
request, which aborts it in the engine and frees its KV blocks, exactly as an HTTP client's disconnect does.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import AsyncIterator

from smg_grpc_proto import vllm_engine_pb2 as pb

from apiserver.context import ServerContext
from apiserver.engine_errors import RequestAborted
from apiserver.errors import Overloaded
from apiserver.grpc.request import GenerateInput
from apiserver.grpc.responses import ResponseBuilder
from apiserver.request_stream import RequestStream
from ipc.messages import FinishReason

# Engine request ids must be unique in the engine even when clients reuse a request id: a per-process random
# prefix and a counter make them so, across API servers and restarts (as apiserver/generation.py does).
_PROCESS_TAG = os.urandom(4).hex()
_COUNTER = itertools.count()


class RunningRequests:
    """This server's Generate calls by request id, for Abort (ids may repeat: all of them are aborted)."""

    def __init__(self):
        self._streams: dict[str, list[RequestStream]] = {}
        self.last_arrival = 0.0  # wall-clock time of the last Generate (GetServerInfo reports it)

    def add(self, request_id: str, stream: RequestStream) -> None:
        self._streams.setdefault(request_id, []).append(stream)

    def remove(self, request_id: str, stream: RequestStream) -> None:
        streams = self._streams.get(request_id)
        if streams is not None:
            streams.remove(stream)
            if not streams:
                del self._streams[request_id]

    def abort(self, request_ids) -> int:
        """Ends the calls of `request_ids` with finish reason "abort"; how many there were."""
        count = 0
        for request_id in request_ids:
            for stream in self._streams.get(request_id, ()):
                stream.fail(RequestAborted())
                count += 1
        return count

    def __len__(self) -> int:
        return sum(len(s) for s in self._streams.values())


async def generate(ctx: ServerContext, call: GenerateInput, running: RunningRequests) -> AsyncIterator[pb.GenerateResponse]:
    """The call's responses; raises Overloaded, EngineDeadError (the caller maps them to statuses)."""
    arrival = time.monotonic()
    running.last_arrival = time.time()
    num_prompt = len(call.prompt)
    try:
        ctx.admission.admit(num_prompt)
    except Overloaded:
        ctx.metrics.count_rejected()
        raise
    builder = ResponseBuilder(call.prompt, call.sampling.n, call.stream, call.sampling.logprobs,
                              call.sampling.prompt_logprobs)
    first_output_at = None
    stream = None
    try:
        engine_id = f"{call.request_id}-{_PROCESS_TAG}{next(_COUNTER)}"
        stream = ctx.engine.generate([(engine_id, call.prompt)], call.sampling, call.priority, call.rank)
        running.add(call.request_id, stream)
        ctx.metrics.count_routed(ctx.engine.ranks_of(stream))
        while not builder.done:
            try:
                outputs = await stream.next_batch()
            except RequestAborted:  # an Abort call named this request
                for response in builder.finish_unfinished(FinishReason.ABORT):
                    yield response
                break
            if first_output_at is None:
                first_output_at = time.monotonic()
            for response in builder.add(outputs):
                yield response
    finally:
        ctx.admission.release(num_prompt)
        if stream is not None:
            running.remove(call.request_id, stream)
            ctx.engine.release(stream)  # aborts in the engine whatever did not finish there
            unfinished = FinishReason.ERROR if stream.ended_by_the_server else FinishReason.ABORT
            ctx.metrics.finished(
                [s.finish_reason or unfinished for s in builder.samples], num_prompt,
                sum(len(s.token_ids) for s in builder.samples), time.monotonic() - arrival,
                None if first_output_at is None else first_output_at - arrival,
            )
