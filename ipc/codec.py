"""Records to ZMQ frames and back: [kind byte, orjson body]. orjson serializes dataclasses natively."""
from __future__ import annotations

from typing import Any

import orjson

from ipc.messages import KIND_OF_RECORD, RECORD_OF_KIND, Record


def encode(record: Record, kinds: dict[type[Record], bytes] = KIND_OF_RECORD) -> list[bytes]:
    """`kinds`: record type -> kind byte, of the contract the record belongs to (ipc.messages' by default)."""
    return [kinds[type(record)], orjson.dumps(record)]


class MalformedMessage(ValueError):
    """Frames that are not a record of the contract. Every receiver drops such a message and carries on.
    `fields`: the body's JSON object when it parsed as one (a receiver may still answer what it can read of it)."""

    def __init__(self, message: str, fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.fields = fields


def decode(frames: list[bytes], records: dict[bytes, type[Record]] = RECORD_OF_KIND) -> Any:
    """The record carried by `frames` ([kind, body]); raises MalformedMessage on anything else.
    `records`: kind byte -> record type, of the contract expected here (ipc.messages' by default)."""
    if len(frames) != 2:
        raise MalformedMessage(f"expected 2 frames, got {len(frames)}")
    kind, body = frames
    record_type = records.get(bytes(kind))
    if record_type is None:
        raise MalformedMessage(f"unknown message kind {bytes(kind)!r}")
    try:
        fields = orjson.loads(body)
    except ValueError as exc:
        raise MalformedMessage(f"bad {record_type.__name__}: {exc}") from None
    try:
        return record_type.from_dict(fields)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # missing, unknown or mistyped fields
        raise MalformedMessage(f"bad {record_type.__name__}: {exc}", fields if isinstance(fields, dict) else None) \
            from None
