"""Streamed chunks as bytes, without building response objects per token: what both endpoints' chunk
writers share. Each request gets a fixed head (`data: {"id":...,"choices":[`); each event is the head plus
one choice's delta (new text, logprobs and finish), in the endpoint's own shape. Writers only format: the
Generation hands out the deltas."""
from __future__ import annotations

import orjson

from apiserver.generation import Delta, Generation
from apiserver.streaming import DONE, error_event
from apiserver.usage import usage
from ipc.config import ServeConfig


def chunk_head(response_id: str, object_name: bytes, created: int, model_name: str) -> bytes:
    return b"".join((
        b'data: {"id":', orjson.dumps(response_id), b',"object":"', object_name, b'","created":',
        str(created).encode(), b',"model":', orjson.dumps(model_name), b',"choices":[',
    ))


class ContinuousUsage:
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk also carries the usage so
    far, the prompt and every choice's tokens as the chunk is written (the events of one write, several choices'
    maybe, carry the same: the usage after all of them); guidellm and aiperf ask for it to time tokens.
    Wraps an endpoint's writer; the usage goes at the end of each of its events (`]}` then the blank line: JSON
    escapes every newline inside a string, so that ending is each event's own)."""

    def __init__(self, writer, generation: Generation, config: ServeConfig):
        self._writer = writer
        self._generation = generation
        self._config = config

    def _with_usage(self, events: bytes) -> bytes:
        if not events:
            return events
        return events.replace(b"]}\n\n", b'],"usage":' + orjson.dumps(usage(self._generation, self._config)) + b"}\n\n")

    def first(self, generation: Generation) -> bytes:
        return self._with_usage(self._writer.first(generation))

    def changes(self, deltas: list[Delta]) -> bytes:
        return self._with_usage(self._writer.changes(deltas))

    def usage(self, generation: Generation) -> bytes:
        return self._writer.usage(generation)

    def end(self, generation: Generation) -> bytes:
        return self._writer.end(generation)

    def error(self, error) -> bytes:
        return self._writer.error(error)


def with_stream_options(writer, options, generation: Generation, config: ServeConfig):
    """`writer`, wrapped in ContinuousUsage where the request's stream_options ask for usage in every chunk."""
    if options is not None and options.include_usage and options.continuous_usage_stats:
        return ContinuousUsage(writer, generation, config)
    return writer


class ChunkWriterBase:
    """Subclasses give `event(index, text, logprobs_json, finish_fields)` and `logprobs_json(delta)`."""

    def __init__(self, head: bytes, config: ServeConfig):
        self._head = head
        self._config = config

    def changes(self, deltas: list[Delta]) -> bytes:
        events = []
        for delta in deltas:
            finish = delta.finish_reason
            logprobs = self.logprobs_json(delta) if delta.logprobs else b"null"
            if not delta.text and finish is None and logprobs == b"null":
                continue  # nothing certain yet: a partial character, or text that may start a stop string
            if finish is not None:
                tail = b',"finish_reason":' + orjson.dumps(finish) + b',"stop_reason":' + orjson.dumps(delta.stop_reason)
            else:
                tail = b',"finish_reason":null'
            events.append(self.event(delta.index, delta.text, logprobs, tail))
        return b"".join(events)

    def usage(self, generation: Generation) -> bytes:
        return self._head + b'],"usage":' + orjson.dumps(usage(generation, self._config)) + b"}\n\n"

    def end(self, generation: Generation) -> bytes:
        return DONE

    def error(self, error) -> bytes:
        return error_event(error) + DONE

    def event(self, index: int, text: str, logprobs: bytes, tail: bytes) -> bytes:
        raise NotImplementedError

    def logprobs_json(self, delta: Delta) -> bytes:
        raise NotImplementedError
