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
from array import array
from functools import cache
from typing import Any, TypeVar

INT64 = (-(2**63), 2**64)  # seeds are unsigned 64-bit, everything else fits a signed one

T = TypeVar("T")


@cache
def _fields(cls: type[Any]) -> dict[str, tuple[object, bool, typing.Callable[[object], bool]]]:
    """name -> (type hint, required, its test) of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                 _checker(hints[f.name]))
        for f in dataclasses.fields(cls)
    }


def checked(cls: type[T], d: object) -> T:
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be an object")
    fields = _fields(cls)  # type: ignore[arg-type]  # a class is hashable; mypy does not see it for type[T]
    if not fields.keys() >= d.keys():
        raise TypeError(f"unknown fields {sorted(set(d) - set(fields))}")
    for name, (hint, required, check) in fields.items():
        if name not in d:
            if required:
                raise KeyError(name)
            continue
        if not check(d[name]):
            raise TypeError(f"{name} is not {getattr(hint, '__name__', hint)}")
    return cls(**d)


def matches(value: object, hint: object) -> bool:
    return _checker(hint)(value)


@cache
def _checker(hint: object) -> typing.Callable[[object], bool]:
    """A test of `value` against `hint`, worked out once per hint: every record from the network runs these, and a
    prompt's token ids are a list of thousands of ints (checked in C: a generic per-element walk cost about 0.5 us
    a token, 62 us for a 128-token request, on the engine's I/O thread, beside the step thread, under one GIL)."""
    if hint is object or hint is typing.Any:
        return lambda value: True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda value: any(check(value) for check in options)
    if hint is list or origin is list:
        args = typing.get_args(hint)
        if not args:
            return lambda value: isinstance(value, list)
        if args[0] is int:
            return _is_int_list
        element = _checker(args[0])
        return lambda value: isinstance(value, list) and all(element(v) for v in value)
    if hint is type(None) or hint is None:
        return lambda value: value is None
    if hint is bool:
        return lambda value: isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value < INT64[1]
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type):
        return lambda value: isinstance(value, hint)
    return lambda value: False


def _is_int_list(value: object) -> bool:
    """A list of ints (not bools, which are ints to isinstance) in INT64's range, in two passes in C: JSON decodes to
    exact types, so the type test is `type(v) is int`; a signed 64-bit array takes the common range at once."""
    if not isinstance(value, list):
        return False
    if list(map(type, value)).count(int) != len(value):
        return False
    try:
        array("q", value)
        return True
    except OverflowError:  # beyond a signed int64: still in range up to INT64's unsigned top
        return bool(INT64[0] <= min(value) and max(value) < INT64[1])
