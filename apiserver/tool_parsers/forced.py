"""The output of `tool_choice` `required` or a named function, which structured outputs force: no parsing of
free text, only of the shapes the grammar allows.

- Named: the whole output is the function's arguments (a JSON object).
- Required: a JSON array of `{"name": ..., "parameters": {...}}` objects, one per call (as vLLM forces it).
"""
from __future__ import annotations

from apiserver.tool_parsers.base import CallState, Parsed, ToolParser
from apiserver.tool_parsers.json_calls import call_at
from apiserver.tool_parsers.json_scan import NotJson, ScanMemo, skip_ws


class NamedCallParser(ToolParser):
    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        return Parsed("", [CallState(self.name, text.lstrip(), final)])


class RequiredCallsParser(ToolParser):
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        calls: list[CallState] = []
        at = skip_ws(text, 0)
        if at >= len(text):
            return Parsed("", [])
        try:
            if text[at] != "[":
                raise NotJson("expected '['")
            at = skip_ws(text, at + 1)
            while at < len(text) and text[at] != "]":
                call, end = call_at(text, at, memo)
                calls.append(call)
                if end is None:
                    break
                at = skip_ws(text, end)
                if at < len(text) and text[at] == ",":
                    at = skip_ws(text, at + 1)
        except NotJson:
            return Parsed(text if final else "", [c for c in calls if c.complete])
        return Parsed("", calls)
