"""Records to ZMQ frames and back: [kind byte, orjson body]. orjson serializes dataclasses natively."""
from __future__ import annotations

import orjson

from ipc.messages import KIND_OF_RECORD, RECORD_OF_KIND


def encode(record) -> list[bytes]:
    return [KIND_OF_RECORD[type(record)], orjson.dumps(record)]


def decode(frames: list[bytes]):
    """The record carried by `frames` ([kind, body]); raises ValueError on anything else."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind, body = frames
    record_type = RECORD_OF_KIND.get(bytes(kind))
    if record_type is None:
        raise ValueError(f"unknown message kind {bytes(kind)!r}")
    return record_type.from_dict(orjson.loads(body))
