"""X-Priority (or vLLM's X-Vllm-Priority): the priority a request's header, or a gRPC call's metadata of the same
name, gives it, read one way by both front ends. As in vLLM, whose docs say the value must be an integer, anything
else is refused rather than silently ignored; and like the body's `priority`, it must fit the engine's 64 bits (a
wider one would fail the request's encoding on its way to the engine)."""
from __future__ import annotations

import re
from typing import Callable

from apiserver.protocol import INT64_MAX, INT64_MIN

PRIORITY_HEADERS = ("x-priority", "x-vllm-priority")
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")  # ASCII digits only; more than 19 is past 64 bits anyway


class BadPriority(ValueError):
    """The header's value is not a 64-bit integer, or the two headers disagree; `name` is the header at fault."""

    def __init__(self, name: str, value: str, message: str | None = None):
        super().__init__(message or f"The {name} header must be an integer from {INT64_MIN} to {INT64_MAX}, "
                                    f"not {value[:40]!r}.")
        self.name = name


def header_priority(get: Callable[[str], str | None]) -> int | None:
    """The priority PRIORITY_HEADERS give (`get`: a header or metadata lookup by name), None when neither is there;
    BadPriority for a value that is not a 64-bit integer, or for both headers with different priorities (which one
    a proxy or this server would honour is anybody's guess, so neither is)."""
    found: tuple[str, int] | None = None
    for name in PRIORITY_HEADERS:
        value = get(name)
        if value is None:
            continue
        text = value.strip()
        if not (_INTEGER.fullmatch(text) and INT64_MIN <= int(text) <= INT64_MAX):
            raise BadPriority(name, value)
        if found is not None and found[1] != int(text):
            raise BadPriority(name, value, f"The {found[0]} ({found[1]}) and {name} ({int(text)}) headers give "
                                           f"different priorities.")
        found = found or (name, int(text))
    return None if found is None else found[1]
