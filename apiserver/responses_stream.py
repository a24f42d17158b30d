"""A streamed Responses API answer: OpenAI's typed events (`event: <type>` and a `data:` object with the same
`type` and an increasing `sequence_number`), from `response.created` to `response.completed` (or
`response.incomplete`, cut off by max_output_tokens), which carries the whole response.

Each output item is announced (`response.output_item.added`), grows by deltas (reasoning text, output text,
function call arguments) and is closed (`.done` events with its full text, then `response.output_item.done`)
before the next one opens, except function calls, which stay open until something other than a call comes or the
stream ends (a parser may send the rest of one call's arguments in the delta that announces the next).
`response.created` and `response.in_progress` go out at once, before the prompt is computed (as OpenAI's do);
the first item comes with the first token. Asked logprobs come with the text deltas they are of (a token whose text
is not out yet with the next), and all of them in the `.done` events and the part.
"""
from __future__ import annotations

import orjson

from apiserver.chat_output import OutputShape, StreamedMessage
from apiserver.generation import Delta, Generation
from apiserver.responses_output import (
    ResponseFrame, ResponseLogprobs, call_item, message_item, reasoning_item, reasoning_text, response_usage,
    status_of, text_part,
)


def sse_event(kind: str, sequence_number: int, fields: dict) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": sequence_number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class _Item:
    """An output item being streamed: its object (as announced) and the pieces of its text or arguments."""

    __slots__ = ("index", "body", "pieces", "logprobs")

    def __init__(self, index: int, body: dict):
        self.index = index
        self.body = body
        self.pieces: list[str] = []
        self.logprobs: list[dict] = []  # a message's text's, when asked


class ResponseEventWriter:
    """The ChunkWriter (apiserver/streaming.py) of POST /v1/responses with `stream: true`; one choice."""

    def __init__(self, frame: ResponseFrame, shape: OutputShape | None, count_tokens,
                 logprobs: ResponseLogprobs | None = None):
        """`logprobs`: asked, for an answer read as plain text (`shape` None)."""
        self._frame = frame
        self._message = None if shape is None else StreamedMessage(shape)
        self._count_tokens = count_tokens  # text -> its number of tokens (the reasoning's, for the usage)
        self._logprobs = logprobs
        self._held_logprobs: list[dict] = []  # of tokens whose text is not out yet
        self._sequence = 0
        self._output: list[dict] = []  # every item announced, in output order
        self._open: list[_Item] = []  # the items not closed yet
        self._calls: dict[int, _Item] = {}  # by the parser's call index
        self._finish: str | None = None

    def _event(self, kind: str, **fields) -> bytes:
        self._sequence += 1
        return sse_event(kind, self._sequence - 1, fields)

    def first(self, generation: Generation) -> bytes:
        response = self._frame.response("in_progress", [])
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                               response=response)

    def changes(self, deltas: list[Delta]) -> bytes:
        events: list[bytes] = []
        for delta in deltas:
            if delta.finish_reason is not None:
                self._finish = delta.finish_reason
            fields: dict
            if self._message is None:
                fields = {"content": delta.text} if delta.text else {}
                if self._logprobs is not None:
                    self._held_logprobs.extend(self._logprobs.of(delta.logprobs))
            else:
                fields = self._message.feed(delta.text, delta.finish_reason is not None)
            if "reasoning_content" in fields:
                self._text(events, "reasoning", fields["reasoning_content"])
            if "content" in fields:
                self._text(events, "message", fields["content"])
            for call in fields.get("tool_calls", ()):
                self._call(events, call)
        return b"".join(events)

    def usage(self, generation: Generation) -> bytes:
        return b""  # in the last event's response, always

    def end(self, generation: Generation) -> bytes:
        events: list[bytes] = []
        status = status_of(self._finish)
        if self._held_logprobs and self._open and self._open[-1].body["type"] == "message":
            self._open[-1].logprobs.extend(self._held_logprobs)  # tokens whose text never came out (a stop string)
        self._close_all(events, status)
        usage = response_usage(generation, self._count_tokens(reasoning_text(self._output)))
        events.append(self._event("response." + status, response=self._frame.response(status, self._output, usage)))
        return b"".join(events)

    def error(self, error) -> bytes:
        """The error event, then the response as failed, OpenAI's last event of a failed response (a client that
        waits for the response's end, as the openai package's stream helper and agents' runners do, gets one):
        its `error` says why, its output is what came before (open items closed as incomplete)."""
        events = [self._event("error", code=error.code or error.type, message=error.message, param=error.param)]
        self._close_all(events, "incomplete")
        failed = self._frame.response("failed", self._output)
        # OpenAI's codes of a failed response: the server's failing, or the request's (a grammar the engine
        # found failing later, a prompt it could not take).
        failed["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                           "message": error.message}
        events.append(self._event("response.failed", response=failed))
        return b"".join(events)

    # Items.
    def _text(self, events: list[bytes], kind: str, text: str) -> None:
        item = self._open[-1] if self._open else None
        if item is None or item.body["type"] != kind:
            self._close_all(events)
            item = self._add(events, kind)
        item.pieces.append(text)
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict = {}
        if kind == "message":
            extra["logprobs"], self._held_logprobs = self._held_logprobs, []
            item.logprobs.extend(extra["logprobs"])
        events.append(self._event(delta_type, item_id=item.body["id"], output_index=item.index, content_index=0,
                                  delta=text, **extra))

    def _add(self, events: list[bytes], kind: str) -> _Item:
        index = len(self._output)
        if kind == "reasoning":
            body = reasoning_item(self._frame.item_id("rs", index), None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            body = message_item(self._frame.item_id("msg", index), None, "in_progress")
            part = text_part("")
        item = self._announce(events, index, body)
        events.append(self._event("response.content_part.added", item_id=body["id"], output_index=index,
                                  content_index=0, part=part))
        return item

    def _announce(self, events: list[bytes], index: int, body: dict) -> _Item:
        self._output.append(body)
        item = _Item(index, body)
        self._open.append(item)
        events.append(self._event("response.output_item.added", output_index=index, item=dict(body)))
        return item

    def _call(self, events: list[bytes], call: dict) -> None:
        function = call["function"]
        item = self._calls.get(call["index"])
        if item is None:
            if self._open and self._open[-1].body["type"] != "function_call":
                self._close_all(events)
            index = len(self._output)
            body = call_item(self._frame.item_id("fc", index), call["id"], function["name"], "", "in_progress")
            item = self._calls[call["index"]] = self._announce(events, index, body)
        piece = function.get("arguments")
        if piece:
            item.pieces.append(piece)
            events.append(self._event("response.function_call_arguments.delta", item_id=item.body["id"],
                                      output_index=item.index, delta=piece))

    def _close_all(self, events: list[bytes], status: str = "completed") -> None:
        """Each open item's `.done` events; the last one takes `status` (a cut-off answer's is incomplete)."""
        for item in self._open:
            last = item is self._open[-1]
            self._close(events, item, status if last else "completed")
        self._open.clear()

    def _close(self, events: list[bytes], item: _Item, status: str) -> None:
        body, index = item.body, item.index
        text = "".join(item.pieces)
        body["status"] = status
        if body["type"] == "function_call":
            body["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", item_id=body["id"], output_index=index,
                                      name=body["name"], arguments=text))
        elif body["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            body["content"] = [part]
            events.append(self._event("response.reasoning_text.done", item_id=body["id"], output_index=index,
                                      content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=body["id"], output_index=index,
                                      content_index=0, part=part))
        else:
            part = text_part(text, item.logprobs)
            body["content"] = [part]
            events.append(self._event("response.output_text.done", item_id=body["id"], output_index=index,
                                      content_index=0, text=text, logprobs=item.logprobs))
            events.append(self._event("response.content_part.done", item_id=body["id"], output_index=index,
                                      content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=index, item=body))
