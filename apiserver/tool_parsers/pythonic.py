"""Pythonic tool calls (Llama 3.2 and 4, ToolACE): the whole output is a Python list of calls with keyword
arguments of literal values, `[get_weather(city="Paris"), get_time()]`; any other output is content. A call is
announced once its name and `(` are in, its arguments (as JSON) go out once its `)` is."""
from __future__ import annotations

import ast
import json
import re

from apiserver.tool_parsers.base import CallState, Parsed, ToolParser, not_tool_calls
from apiserver.tool_parsers.json_scan import skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPEN, _CLOSE = "([{", ")]}"


class PythonicParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        at = skip_ws(text, 0)
        if at >= len(text):
            return Parsed(text if final else "", [])
        if text[at] != "[":
            return Parsed(text, [])
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
                end = _call_end(text, paren)
                if end is None:
                    calls.append(CallState(name.group(), ""))
                    break
                calls.append(CallState(name.group(), _arguments(text[at:end]), True))
                at = skip_ws(text, end)
                if at < len(text) and text[at] == ",":
                    at = skip_ws(text, at + 1)
                elif at < len(text) and text[at] != "]":
                    raise ValueError("expected ',' or ']'")
        except (ValueError, SyntaxError):
            return not_tool_calls(text, "", calls, final)
        return Parsed("", calls)


def _call_end(text: str, paren: int) -> int | None:
    """The end (exclusive) of the call whose '(' is at text[paren], None while it is open."""
    depth = 0
    i = paren
    while i < len(text):
        ch = text[i]
        if ch in "'\"":
            close = text.find(ch, i + 1)
            while close > 0 and text[close - 1] == "\\":
                close = text.find(ch, close + 1)
            if close < 0:
                return None
            i = close
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _arguments(call_text: str) -> str:
    call = ast.parse(call_text, mode="eval").body
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError("a tool call takes keyword arguments only")
    return json.dumps({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, ensure_ascii=False)
