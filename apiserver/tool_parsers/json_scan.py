"""Where JSON values begin and end in text that may stop anywhere (a model's output, token by token).

The tool-call parsers need spans, not values: a call's arguments are streamed as the model's own JSON text, which
only grows, so the text sent so far is always a prefix of the final arguments. Incomplete values give None ends;
text that cannot be JSON raises NotJson.

A streamed choice's text is parsed again after every delta, so each scan keeps what it found in the choice's
ScanMemo: a value found complete stays complete in the longer text, and the scan of an open one resumes where it
stopped. Parsing after a delta then costs about the delta, not the text: parsed whole each time, a 42 KB file
written through a tool call took 8.5 s of the API server's CPU over its 10,000 deltas (quadratic). Runs of
characters that change nothing (a string's letters, whitespace, a number's digits) are skipped by regular
expressions, in C.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple


class Brackets(NamedTuple):
    """A syntax's brackets, and what to skip between them: anything but its quotes and brackets."""

    closing: dict[str, str]
    plain: re.Pattern


JSON = Brackets({"{": "}", "[": "]"}, re.compile(r'[^"{}\[\]]*'))
PYTHON = Brackets({"(": ")", "[": "]", "{": "}"}, re.compile(r"""[^'"()\[\]{}]*"""))  # pythonic tool calls
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_SCALAR = re.compile(r"[^ \t\r\n,}\]]*")  # a number, true, false or null: up to what ends it
# A string's characters up to its closing quote (or an escape that the text cuts from its character), by quote.
_STRING_BODY = {quote: re.compile(rf"[^{quote}\\]*(?:\\.[^{quote}\\]*)*", re.DOTALL) for quote in "\"'"}


class NotJson(ValueError):
    """The text is not (the beginning of) the JSON expected there."""


class ScanMemo:
    """What the scans of one growing text found, by where each value starts: the ends of those complete, where the
    scan of each open one stopped (to go on there), and those that cannot be JSON (no longer text makes them so)."""

    __slots__ = ("ends", "objects", "calls", "open_strings", "open_containers", "open_objects", "not_json")

    def __init__(self):
        self.ends: dict[int, int] = {}
        self.calls: dict[int, tuple] = {}  # start: a parser's complete tool call there, as it made it
        self.objects: dict[int, tuple[dict[str, tuple[int, int | None]], int]] = {}  # start: (members, end)
        self.open_strings: dict[int, int] = {}  # start: where to go on
        self.open_containers: dict[int, tuple[int, list[str]]] = {}  # start: (where to go on, closers awaited)
        # start: (where the first member not yet complete begins, the complete members)
        self.open_objects: dict[int, tuple[int, dict[str, tuple[int, int | None]]]] = {}
        self.not_json: dict[int, str] = {}  # start: why


def decoded(value: str):
    """A complete value's text, decoded. One the scan let through but JSON does not take (a string with an escape
    such as \\q) is not JSON either (before, json's own error escaped the parser and ended the answer)."""
    try:
        return json.loads(value, parse_constant=_not_a_json_constant)
    except ValueError as exc:
        raise NotJson(str(exc)) from None


def _not_a_json_constant(name: str):
    raise NotJson(f"{name} is Python's, not JSON")  # json.loads takes NaN and Infinity; a client's parser would not


def run_end(pattern: re.Pattern, text: str, i: int) -> int:
    """Where the run of `pattern` that starts at text[i] ends (every pattern here matches the empty run)."""
    run = pattern.match(text, i)
    assert run is not None
    return run.end()


def skip_ws(text: str, i: int) -> int:
    return run_end(_WHITESPACE, text, i)


def value_end(text: str, i: int, memo: ScanMemo) -> int | None:
    """The end (exclusive) of the JSON value that starts at text[i], None when the text stops before it does.
    A number at the very end is incomplete: more digits may follow."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return string_end(text, i, memo)
    if first in JSON.closing:
        return container_end(text, i, memo, JSON)
    if first in "-0123456789tfn":
        j = run_end(_SCALAR, text, i)
        return j if j < len(text) else None
    raise NotJson(f"unexpected {first!r}")


def string_end(text: str, i: int, memo: ScanMemo) -> int | None:
    """The end (exclusive) of the string whose opening quote (" or ') is at text[i], None while it is open."""
    end = memo.ends.get(i)
    if end is not None:
        return end
    quote = text[i]
    j = run_end(_STRING_BODY[quote], text, memo.open_strings.get(i, i + 1))
    if j < len(text) and text[j] == quote:
        memo.open_strings.pop(i, None)
        memo.ends[i] = j + 1
        return j + 1
    memo.open_strings[i] = j
    return None


def container_end(text: str, i: int, memo: ScanMemo, brackets: Brackets) -> int | None:
    """The end (exclusive) of what the bracket at text[i] opens, None while it is open; NotJson where a bracket
    closes what it did not open."""
    end = memo.ends.get(i)
    if end is not None:
        return end
    if i in memo.not_json:
        raise NotJson(memo.not_json[i])
    closing, plain = brackets
    # Taken out of the memo while it goes on: a scan that raises leaves nothing half updated there.
    went_on = memo.open_containers.pop(i, None)
    j, awaited = went_on if went_on is not None else (i + 1, [closing[text[i]]])
    n = len(text)
    while (j := run_end(plain, text, j)) < n:
        ch = text[j]
        if ch in _STRING_BODY:
            end = string_end(text, j, memo)
            if end is None:
                break  # goes on from the string, whose own scan goes on where it stopped
            j = end
            continue
        if ch in closing:
            awaited.append(closing[ch])
        elif ch != awaited.pop():
            memo.not_json[i] = f"mismatched {ch!r}"
            raise NotJson(memo.not_json[i])
        elif not awaited:
            memo.ends[i] = j + 1
            return j + 1
        j += 1
    memo.open_containers[i] = (j, awaited)
    return None


def object_members(text: str, i: int, memo: ScanMemo) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object starting at text[i] ('{'): {key: (value start, value end or None)} for every
    key complete so far, and the object's end (None while it is open). The members are not to be changed."""
    if i >= len(text) or text[i] != "{":
        raise NotJson("expected an object")
    done = memo.objects.get(i)
    if done is not None:
        return done
    if i in memo.not_json:
        raise NotJson(memo.not_json[i])
    went_on = memo.open_objects.pop(i, None)
    j, members = went_on if went_on is not None else (i + 1, {})
    j = skip_ws(text, j)  # (whitespace the shorter text ended in may go on)
    try:
        while j < len(text):
            if text[j] == "}":
                memo.objects[i] = members, j + 1
                return members, j + 1
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] != '"':
                raise NotJson("expected a key")
            key_end = string_end(text, j, memo)
            if key_end is None:
                break
            key = decoded(text[j:key_end])
            colon = skip_ws(text, key_end)
            if colon >= len(text):
                break
            if text[colon] != ":":
                raise NotJson("expected ':'")
            start = skip_ws(text, colon + 1)
            end = value_end(text, start, memo)
            if start >= len(text):
                break
            if end is None:
                memo.open_objects[i] = j, members
                return {**members, key: (start, None)}, None
            members[key] = (start, end)
            j = skip_ws(text, end)
    except NotJson as exc:
        memo.not_json[i] = str(exc)
        raise
    memo.open_objects[i] = j, members
    return members, None
