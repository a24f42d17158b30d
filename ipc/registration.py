"""The contract between a headless node's supervisor and the head's registration port.

A headless node says HELLO every beat (a quarter of --engine-ping-interval): which ranks it runs, where their
engines listen, and the model they serve. The same record registers the node the first time, re-registers it
with a head that restarted, and is its heartbeat: the head holds no state a node must rebuild, and a node never
has to know whether the head it talks to is the one it registered with. The head answers each HELLO with
ACCEPTED (its own id, so a node notices a new head) or REFUSED (one line: why), and a node that stops says
LEAVING, so its ranks are marked down at once instead of after a silent interval. Before it leaves, a node told to
stop says DRAINING every beat (in place of HELLO, answered ACCEPTED too): its ranks get no new requests while the
ones they run finish.

These messages come from the network: every field is checked for its type before anyone reads it, and a
message that fails is dropped (MalformedMessage), never raised further. The registration port refuses messages
over 64 KiB, which bounds the lists and strings in them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ipc.codec import MalformedMessage, decode, encode
from ipc.messages import CheckedRecord, Record


@dataclass
class NodeHello(CheckedRecord):
    node_id: str  # random, per run of a headless supervisor
    node_name: str  # its host name, for the log lines
    data_parallel_size: int
    ranks: list[int]
    addresses: list[str]  # tcp:// of each rank's engine, in the order of `ranks`
    model_name: str  # the served model name
    vocab_size: int
    max_model_len: int
    head_id: str  # the head this node last heard ACCEPTED from ("" before the first)


@dataclass
class NodeLeaving(CheckedRecord):
    node_id: str
    reason: str


@dataclass
class NodeDraining(CheckedRecord):
    node_id: str
    reason: str


@dataclass
class HelloAccepted(CheckedRecord):
    head_id: str


@dataclass
class HelloRefused(CheckedRecord):
    reason: str


_KIND_OF: dict[type[Record], bytes] = {NodeHello: b"H", NodeLeaving: b"L", NodeDraining: b"D", HelloAccepted: b"A",
                                       HelloRefused: b"F"}
_RECORD_OF = {kind: record for record, kind in _KIND_OF.items()}


def encode_node_message(record: Record) -> list[bytes]:
    return encode(record, _KIND_OF)


def decode_node_message(frames: list[bytes]) -> Any:
    """The record in `frames`; MalformedMessage for anything that is not one of this contract's, well typed."""
    return decode(frames, _RECORD_OF)


__all__ = ["NodeHello", "NodeLeaving", "NodeDraining", "HelloAccepted", "HelloRefused", "MalformedMessage",
           "encode_node_message", "decode_node_message"]
