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
    """The header's value is not a 64-bit integer; `name` is the header."""

    def __init__(self, name: str, value: str):
        super().__init__(f"The {name} header must be an integer from {INT64_MIN} to {INT64_MAX}, not {value[:40]!r}.")
        self.name = name


def header_priority(get: Callable[[str], str | None]) -> int | None:
    """The priority the first of PRIORITY_HEADERS present gives (`get`: a header or metadata lookup by name), None
    when none is; BadPriority for a value that is not a 64-bit integer."""
    for name in PRIORITY_HEADERS:
        value = get(name)
        if value is not None:
            text = value.strip()
            if _INTEGER.fullmatch(text) and INT64_MIN <= int(text) <= INT64_MAX:
                return int(text)
            raise BadPriority(name, value)
    return None
