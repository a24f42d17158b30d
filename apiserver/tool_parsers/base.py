"""What every tool-call parser gives, and how its results become OpenAI's tool calls, whole or streamed.

A parser reads the text a choice has generated so far and says what of it is content and which tool calls it
holds: `parse(text, final, memo) -> Parsed`. It is called again on the longer text after every delta, with the
choice's ScanMemo, which keeps what its scans found so that each call costs about the delta (json_scan.py), and it
must be consistent: the content and each call's arguments only ever grow, so
what was streamed stays a prefix of the final message. Until `final`, a parser holds back text that may still
turn out to start a tool call.

Streamed, `ToolCallStream` turns the growth into OpenAI's deltas: a call's first delta carries its `index`, `id`,
`type` and `function.name` (with empty arguments), the later ones `index` and pieces of `function.arguments`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from apiserver.tool_parsers.json_scan import ScanMemo


@dataclass
class CallState:
    name: str | None  # None until the whole name is known
    arguments: str  # the arguments' JSON text so far
    complete: bool = False


class Parsed(NamedTuple):
    content: str
    calls: list[CallState]


class ToolParser:
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        """`memo`: what the scans of this text's shorter versions found (a streamed choice's); None: a new one."""
        raise NotImplementedError

    def settled(self, text: str) -> int | None:
        """For a stream without a call yet: how many leading characters of `text` are content whatever follows
        (parsing the rest gives the rest of what parsing all of it gives), so that the stream need not keep them;
        None: all of it, and all that follows (the output did not begin as calls). Kept whole, a long answer's
        text was copied and searched whole after every delta."""
        return 0


def not_tool_calls(text: str, content: str, calls: list[CallState], final: bool) -> Parsed:
    """What was parsed when the text turned out not to be the tool calls it began as: the complete calls so far
    (an incomplete one is dropped); with none, at the end, the whole text is content (as vLLM answers)."""
    complete = [c for c in calls if c.complete]
    if final and not complete:
        return Parsed(text, [])
    return Parsed(content, complete)


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the beginning of `marker` (to hold them back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def tool_calls_json(calls: list[CallState]) -> list[dict]:
    """The message's `tool_calls` of a whole answer."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.name is not None]


class ToolCallStream:
    """One streamed choice: feed it each text delta, it answers the new content and the tool-call deltas. It keeps
    the choice's text from where a call may begin (`ToolParser.settled`)."""

    __slots__ = ("parser", "text", "_memo", "_content_sent", "_sent", "_all_content")

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._memo = ScanMemo()
        self._content_sent = 0  # of the text kept
        self._sent: list[int] = []  # per announced call: how much of its arguments went out
        self._all_content = False

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self._all_content:
            return text, []
        self.text += text
        content = self._settle() if not self._sent else ""
        if self._all_content:
            return content, []
        parsed = self.parser.parse(self.text, final, self._memo)
        content += parsed.content[self._content_sent:]
        self._content_sent = len(parsed.content)
        return content, self._call_deltas(parsed.calls)

    def _settle(self) -> str:
        """Drops the text that is content for good, and answers what of it was not sent yet."""
        settled = self.parser.settled(self.text)
        if settled is None:
            self._all_content = True
            settled = len(self.text)
        if not settled:
            return ""
        unsent = self.text[self._content_sent:settled]
        self.text = self.text[settled:]
        self._content_sent = max(0, self._content_sent - settled)
        self._memo = ScanMemo()  # (its positions are in the text it scanned)
        return unsent

    def _call_deltas(self, calls: list[CallState]) -> list[dict]:
        deltas: list[dict] = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # a later call cannot be announced before this one
            if index == len(self._sent):
                self._sent.append(0)
                deltas.append({"index": index, "id": new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self._sent[index]
            if len(call.arguments) > sent:
                self._sent[index] = len(call.arguments)
                piece = call.arguments[sent:]
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas
