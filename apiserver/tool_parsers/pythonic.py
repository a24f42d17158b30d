"""Pythonic tool calls (Llama 3.2 and 4, ToolACE): the whole output is a Python list of calls with keyword
arguments of literal values, `[get_weather(city="Paris"), get_time()]`; any other output is content. A call is
announced once its name and `(` are in, its arguments (as JSON) go out once its `)` is."""
from __future__ import annotations

import ast
import json
import re

from apiserver.tool_parsers.base import CallState, Parsed, ToolParser, not_tool_calls
from apiserver.tool_parsers.json_scan import PYTHON, ScanMemo, container_end, skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
# What Python's parser raises on text that is no call: besides syntax errors, MemoryError ("parser stack
# overflow") and RecursionError for a long chain of operators, `a=-----...1` or `a=1+1+...` (they escaped the
# parser, and the answer was a 500).
_NOT_A_CALL = (ValueError, SyntaxError, MemoryError, RecursionError)


class PythonicParser(ToolParser):
    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        at = skip_ws(text, 0)
        if at >= len(text):
            return Parsed(text if final else "", [])
        if text[at] != "[":
            return Parsed(text, [])
        memo = ScanMemo() if memo is None else memo
        calls: list[CallState] = []
        try:
            at = skip_ws(text, at + 1)
            while at < len(text) and text[at] != "]":
                name = _NAME.match(text, at)
                if name is None:
                    raise ValueError("expected a function name")
                paren = skip_ws(text, name.end())
                if paren >= len(text):
                    break
                if text[paren] != "(":
                    raise ValueError("expected '('")
                end = container_end(text, paren, memo, PYTHON)
                if end is None:
                    calls.append(CallState(name.group(), ""))
                    break
                calls.append(_complete_call(text, at, end, name.group(), memo))
                at = skip_ws(text, end)
                if at < len(text) and text[at] == ",":
                    at = skip_ws(text, at + 1)
                elif at < len(text) and text[at] != "]":
                    raise ValueError("expected ',' or ']'")
        except _NOT_A_CALL:
            return not_tool_calls(text, "", calls, final)
        return Parsed("", calls)

    def settled(self, text: str) -> int | None:
        at = skip_ws(text, 0)
        return None if at < len(text) and text[at] != "[" else 0


def _complete_call(text: str, at: int, end: int, name: str, memo: ScanMemo) -> CallState:
    """The call text[at:end], parsed once: as the text grows after it, the memo keeps it, or why it is no call."""
    if at in memo.not_json:
        raise ValueError(memo.not_json[at])
    if at not in memo.calls:
        try:
            memo.calls[at] = CallState(name, _arguments(text[at:end]), True),
        except _NOT_A_CALL as exc:
            memo.not_json[at] = str(exc)
            raise
    return memo.calls[at][0]


def _arguments(call_text: str) -> str:
    call = ast.parse(call_text, mode="eval").body
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError("a tool call takes keyword arguments only")
    return json.dumps({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, ensure_ascii=False)
