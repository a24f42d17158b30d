"""Tool calls written as JSON objects `{"name": ..., "arguments" or "parameters": {...}}` (Hermes, Llama 3 JSON,
and the array that `tool_choice: required` forces): one call's state from the object at a position of the text."""
from __future__ import annotations

from apiserver.tool_parsers.base import CallState
from apiserver.tool_parsers.json_scan import NotJson, ScanMemo, decoded, object_members

ARGUMENT_KEYS = ("arguments", "parameters")


def call_at(text: str, start: int, memo: ScanMemo | None) -> tuple[CallState, int | None]:
    """The call whose object starts at text[start], and where the object ends (None while it is open). `memo`:
    the text's, when it is parsed again as it grows (None: it is parsed once)."""
    memo = ScanMemo() if memo is None else memo
    done = memo.calls.get(start)
    if done is not None:
        return done
    members, end = object_members(text, start, memo)
    name = None
    if "name" in members:
        name_start, name_end = members["name"]
        if name_end is not None:
            name = decoded(text[name_start:name_end])
            if not isinstance(name, str):
                raise NotJson("the name of a tool call must be a string")
    arguments = ""
    for key in ARGUMENT_KEYS:
        if key in members:
            arguments = _arguments_text(text, *members[key])
            break
    else:
        if end is not None:
            arguments = "{}"  # a call without arguments
    if end is None:
        return CallState(name, arguments), None
    if name is None:
        raise NotJson("a tool call needs a name")
    decoded(arguments)  # the scan checks brackets and strings only: `{"a": tru}` is not JSON either
    memo.calls[start] = CallState(name, arguments, True), end
    return memo.calls[start]


def _arguments_text(text: str, start: int, end: int | None) -> str:
    """The arguments' JSON text so far. Arguments sent as a JSON string holding the JSON come out decoded, and
    only once complete (the escaped text is not a prefix of the decoded one)."""
    if text[start] == '"':
        return decoded(text[start:end]) if end is not None else ""
    return text[start:end] if end is not None else text[start:]

