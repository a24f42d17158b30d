"""Llama 3.x JSON tool calls: the whole output is one or more `{"name": ..., "parameters": {...}}` objects
separated by `;` (optionally after `<|python_tag|>`); any other output is content."""
from __future__ import annotations

from apiserver.tool_parsers.base import CallState, Parsed, ToolParser, not_tool_calls
from apiserver.tool_parsers.json_calls import call_at
from apiserver.tool_parsers.json_scan import NotJson, ScanMemo, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        start = _calls_start(text, final)
        if start is None:
            return Parsed("", [])  # nothing yet, or what may still become the tag
        if start >= len(text):
            return Parsed(text if final else "", [])
        if text[start] != "{":
            return Parsed(text, [])
        calls: list[CallState] = []
        try:
            while start < len(text):
                call, end = call_at(text, start, memo)
                calls.append(call)
                if end is None:
                    break
                start = skip_ws(text, end)
                if start < len(text):
                    if text[start] != ";":
                        raise NotJson("expected ';' between tool calls")
                    start = skip_ws(text, start + 1)
        except NotJson:
            return not_tool_calls(text, "", calls, final)
        return Parsed("", calls)

    def settled(self, text: str) -> int | None:
        start = _calls_start(text, False)
        return None if start is not None and start < len(text) and text[start] != "{" else 0


def _calls_start(text: str, final: bool) -> int | None:
    """Where the calls would begin: past whitespace and <|python_tag|>; None while the text may still become the
    tag (not at the end)."""
    start = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, start):
        return skip_ws(text, start + len(PYTHON_TAG))
    if not final and PYTHON_TAG.startswith(text[start:]):
        return None
    return start
