"""Records from the network are checked field by field before anyone reads them.

An engine on a TCP port, and the head's registration port, take messages from other machines: a record whose
JSON has a field of the wrong type (a buggy or hostile peer) must be dropped as malformed at decoding, not raise
later inside an engine step or the supervisor's loop. `checked(cls, d)` builds the dataclass `cls` from the dict
`d` only if every field the dict gives has the type `cls` declares (and every field without a default is there);
otherwise it raises TypeError or KeyError, which ipc.codec turns into MalformedMessage.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, TypeVar

INT64 = (-(2**63), 2**64)  # seeds are unsigned 64-bit, everything else fits a signed one

T = TypeVar("T")


@cache
def _fields(cls: type[Any]) -> dict[str, tuple[object, bool]]:
    """name -> (type hint, required) of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    }


def checked(cls: type[T], d: object) -> T:
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be an object")
    fields = _fields(cls)  # type: ignore[arg-type]  # a class is hashable; mypy does not see it for type[T]
    unknown = set(d) - set(fields)
    if unknown:
        raise TypeError(f"unknown fields {sorted(unknown)}")
    for name, (hint, required) in fields.items():
        if name not in d:
            if required:
                raise KeyError(name)
            continue
        if not matches(d[name], hint):
            raise TypeError(f"{name} is not {getattr(hint, '__name__', hint)}")
    return cls(**d)


def matches(value: object, hint: object) -> bool:
    if hint is object or hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, h) for h in typing.get_args(hint))
    if hint is list or origin is list:
        if not isinstance(value, list):
            return False
        args = typing.get_args(hint)
        return not args or all(matches(v, args[0]) for v in value)
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value < INT64[1]
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return False
