"""Hermes (NousResearch Hermes 2 Pro, Qwen 2.5 and the template shipped here for the embedded model): content, then
one or more `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. Content is the text before the
first call; text between and after calls is dropped, as in vLLM."""
from __future__ import annotations

from apiserver.tool_parsers.base import CallState, Parsed, ToolParser, held_prefix, not_tool_calls
from apiserver.tool_parsers.json_calls import call_at
from apiserver.tool_parsers.json_scan import NotJson, ScanMemo, skip_ws

START = "<tool_call>"


class HermesParser(ToolParser):
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else text[:len(text) - held_prefix(text, START)], [])
        content = text[:first]
        calls: list[CallState] = []
        at = first
        try:
            while at >= 0:
                start = skip_ws(text, at + len(START))
                if start >= len(text):
                    break
                call, end = call_at(text, start, memo)
                calls.append(call)
                if end is None:
                    break
                at = text.find(START, end)
        except NotJson:
            return not_tool_calls(text, content, calls, final)
        if final and not calls:  # a tag the output ended at: text, as the whole answer reads it
            return Parsed(text, [])
        return Parsed(content, calls)

    def settled(self, text: str) -> int | None:
        first = text.find(START)
        return first if first >= 0 else len(text) - held_prefix(text, START)
