"""A chat choice's text as OpenAI's message: reasoning (`--reasoning-parser`), then content and tool calls (the
tool-call parser a request's tools and tool_choice need). Used only when a request has one of them: plain
requests stream their text as it is.

Whole answers parse the final text once; streams parse the text so far after every delta and send what grew
(apiserver/tool_parsers/base.py says why that is consistent).
"""
from __future__ import annotations

from typing import NamedTuple

from apiserver.reasoning import split
from apiserver.tool_parsers import ToolCallStream, ToolParser, tool_calls_json


class OutputShape(NamedTuple):
    """How a request's choices are read: reasoning (and whether the prompt opened it), tool calls (a factory of
    parsers: a parser holds no state, but forced calls know their function's name)."""

    reasoning: bool
    opened: bool
    tool_parser: ToolParser | None


def message(text: str, shape: OutputShape, finish_reason: str | None) -> tuple[dict, str | None]:
    """The whole answer's message and its finish reason (`tool_calls` when it calls tools)."""
    reasoning, content = split(text, shape.opened, True) if shape.reasoning else ("", text)
    out: dict = {"role": "assistant", "content": content}
    if shape.reasoning:
        out["reasoning_content"] = reasoning or None
        if reasoning and not content:
            out["content"] = None  # it reasoned until the end (max_tokens)
    if shape.tool_parser is not None:
        parsed = shape.tool_parser.parse(content, final=True)
        if parsed.calls or (content and not parsed.content):
            # Text the parser read as calls is not content, also when no call in it is whole yet (a forced
            # call cut off by max_tokens after its "["): what a stream of the same text sent as content, none.
            out["content"] = parsed.content or None
        if parsed.calls:
            out["tool_calls"] = tool_calls_json(parsed.calls)
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    return out, finish_reason


class StreamedMessage:
    """One streamed choice: its text deltas in, the delta fields out."""

    __slots__ = ("_shape", "_text", "_reasoning_sent", "_content_sent", "_tools")

    def __init__(self, shape: OutputShape):
        self._shape = shape
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._tools = None if shape.tool_parser is None else ToolCallStream(shape.tool_parser)

    @property
    def calls_tools(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, final: bool) -> dict:
        """The delta's fields (reasoning_content, content, tool_calls) for what the output grew by."""
        fields: dict = {}
        self._text += text
        if self._shape.reasoning:
            reasoning, content = split(self._text, self._shape.opened, final)
            if len(reasoning) > self._reasoning_sent:
                fields["reasoning_content"] = reasoning[self._reasoning_sent:]
                self._reasoning_sent = len(reasoning)
        else:
            content = self._text
        new_content = content[self._content_sent:]
        self._content_sent = len(content)
        if self._tools is not None:
            new_content, calls = self._tools.feed(new_content, final)
            if calls:
                fields["tool_calls"] = calls
        if new_content:
            fields["content"] = new_content
        return fields
