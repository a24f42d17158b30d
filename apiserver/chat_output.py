"""A chat choice's text as OpenAI's message: reasoning (`--reasoning-parser`), then content and tool calls (the
tool-call parser a request's tools and tool_choice need). Used only when a request has one of them: plain
requests stream their text as it is.

Whole answers parse the final text once; streams take each delta as it comes and send what it adds
(apiserver/tool_parsers/base.py says why that is consistent).
"""
from __future__ import annotations

from typing import NamedTuple

from apiserver.reasoning import ReasoningStream, split
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
        # Under both names, as vLLM writes it: `reasoning` (vLLM's since v0.11.1, OpenRouter's) and
        # `reasoning_content` (DeepSeek's, which clients written for older vLLM read).
        out["reasoning"] = out["reasoning_content"] = reasoning or None
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
    """One streamed choice: its text deltas in, the delta fields out. It keeps no more of the text than the
    reasoning and tool-call streams need to decide what the next delta is."""

    __slots__ = ("_reasoning", "_tools")

    def __init__(self, shape: OutputShape):
        self._reasoning = ReasoningStream(shape.opened) if shape.reasoning else None
        self._tools = None if shape.tool_parser is None else ToolCallStream(shape.tool_parser)

    @property
    def calls_tools(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, final: bool) -> dict:
        """The delta's fields (reasoning, reasoning_content, content, tool_calls) for what the output grew by."""
        fields: dict = {}
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
            if reasoning:
                fields["reasoning"] = fields["reasoning_content"] = reasoning  # both names: see message()
        if self._tools is not None:
            content, calls = self._tools.feed(content, final)
            if calls:
                fields["tool_calls"] = calls
        if content:
            fields["content"] = content
        return fields
