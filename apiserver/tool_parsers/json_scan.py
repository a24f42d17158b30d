"""Where JSON values begin and end in text that may stop anywhere (a model's output, token by token).

The tool-call parsers need spans, not values: a call's arguments are streamed as the model's own JSON text, which
only grows, so the text sent so far is always a prefix of the final arguments. Incomplete values give None ends;
text that cannot be JSON raises NotJson.
"""
from __future__ import annotations

import json

WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}
_SCALAR_END = frozenset(WHITESPACE + ",}]")


class NotJson(ValueError):
    """The text is not (the beginning of) the JSON expected there."""


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value that starts at text[i], None when the text stops before it does.
    A number at the very end is incomplete: more digits may follow."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in _CLOSE:
        return _container_end(text, i)
    if first in "-0123456789tfn":
        j = i
        while j < len(text) and text[j] not in _SCALAR_END:
            j += 1
        return j if j < len(text) else None
    raise NotJson(f"unexpected {first!r}")


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    n = len(text)
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def _container_end(text: str, i: int) -> int | None:
    stack = [_CLOSE[text[i]]]
    j = i + 1
    n = len(text)
    while j < n:
        ch = text[j]
        if ch == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "}]":
            if ch != stack.pop():
                raise NotJson(f"mismatched {ch!r}")
            if not stack:
                return j + 1
        j += 1
    return None


def object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object starting at text[i] ('{'): {key: (value start, value end or None)} for every
    key complete so far, and the object's end (None while it is open)."""
    if i >= len(text) or text[i] != "{":
        raise NotJson("expected an object")
    members: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            raise NotJson("expected a key")
        key_end = _string_end(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise NotJson("expected ':'")
        start = skip_ws(text, j + 1)
        end = value_end(text, start)
        if start >= len(text):
            return members, None
        members[key] = (start, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None
