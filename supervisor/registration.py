"""The head's registration port: where headless nodes register their ranks, and keep them registered.

A ROUTER on --data-parallel-address:--data-parallel-rpc-port (CURVE with the deployment's key: only holders
may register, since a registered "engine" is sent prompts). Each NodeHello (ipc/registration.py) is checked in
full every time, answered ACCEPTED or REFUSED with one line, and logged once when it changes something:

- a rank's registration (a new node, or a node at a new address) is a RankJoined event for the supervisor;
- a rank is lost when its node says LEAVING (it stopped, or one of its engines died) or when its node has sent
  nothing for --engine-ping-interval seconds (nodes beat four times per interval, from their supervisor's
  loop, which never runs a model step: a long engine step cannot look like a lost node). Each is a RankLost;
- a rank drains when its node, told to stop, says DRAINING (in place of its HELLO, so it is a beat too): a
  RankDraining, once per rank. A DRAINING from a node that holds no rank here is dropped without an answer.

The registry outlives a group restarted in place (--on-engine-failure restart): the nodes stay registered.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import zmq

from ipc.curve import CurveKeys
from ipc.model_info import ModelInfo
from ipc.registration import (HelloAccepted, HelloRefused, MalformedMessage, NodeDraining, NodeHello, NodeLeaving,
                              decode_node_message, encode_node_message)
from ipc.shared_state import RANK_NODE_LEFT, RANK_NODE_SILENT
from ipc.sockets import bind_router, is_tcp, tcp_address
from supervisor.events import RankDraining, RankJoined, RankLost
from supervisor.layout import Layout
from supervisor.refused_handshakes import RefusedHandshakes

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024  # a HELLO is a few hundred bytes: refuse what could only be an attack
REMEMBERED = 1024  # refused node ids remembered (one error line each), and ids of nodes that left


@dataclass
class _Registration:
    node_id: str
    node_name: str
    address: str
    last_seen: float
    hello: NodeHello  # the last one, checked again when the head learns its own model's facts
    draining: bool = False


class Registry:
    def __init__(self, config, layout: Layout, curve: CurveKeys | None):
        self.head_id = uuid.uuid4().hex
        self.layout = layout
        self.model_name = config.model_name
        self.model: ModelInfo | None = None  # the head's own, once its local engines are ready
        self.silence = config.engine_ping_interval
        self.address = tcp_address(config.data_parallel_address, config.data_parallel_rpc_port)
        self._zmq = zmq.Context(io_threads=1)
        try:
            self._sock = bind_router(self._zmq, self.address, curve, max_message_bytes=MAX_MESSAGE_BYTES)
        except zmq.ZMQError as exc:
            self._zmq.term()
            raise OSError(f"cannot listen for headless nodes on {self.address}: {exc}") from None
        self._refused_handshakes = RefusedHandshakes(self._sock, keyed=curve is not None)
        self.ranks: dict[int, _Registration] = {}
        self._events: list = []
        # Node ids refused once: one error line each. The last REMEMBERED only: the ids come from the network,
        # and whoever can reach the port could send new ones without end.
        self._refused: dict[str, None] = {}
        self._left: dict[str, None] = {}  # nodes that said LEAVING: a HELLO of theirs still queued is stale

    # For the event source.
    def filenos(self) -> list[int]:
        return [self._sock.fileno(), self._refused_handshakes.fileno()]

    def seconds_to_next(self) -> float | None:
        if not self.ranks:
            return None
        oldest = min(r.last_seen for r in self.ranks.values())
        return max(0.0, oldest + self.silence - time.monotonic())

    def take(self) -> list:
        """What happened since the last call: RankJoined and RankLost events."""
        self._refused_handshakes.take()
        for identity, message in self._latest_messages():
            self._on_message(identity, message)
        self._check_silence()
        events, self._events = self._events, []
        return events

    def expect_model(self, model: ModelInfo) -> None:
        """The head's local engines are ready: from now on a node must serve a model with the same facts; one
        registered before that which does not is dropped (and refused at its next beat)."""
        self.model = model
        for held in list(self.ranks.values()):
            refusal = self._refusal(held.hello)
            if refusal is not None and held.node_id in {r.node_id for r in self.ranks.values()}:
                self._drop_node(held.node_id, f"refused: {refusal}", RANK_NODE_LEFT)

    def registered(self) -> dict[int, str]:
        """Rank -> engine address of every rank registered now."""
        return {rank: r.address for rank, r in self.ranks.items()}

    def close(self) -> None:
        self._refused_handshakes.close()
        self._sock.close(linger=0)
        self._zmq.term()

    # Messages.
    def _latest_messages(self) -> list[tuple[bytes, object]]:
        """What waits on the port, decoded (a malformed message dropped with a line), the last message of each peer
        only: after the head was stopped (SIGSTOP, a long pause), a node's old HELLOs wait before its LEAVING, and
        taken in turn they registered a node that had gone (a needless rolling restart, whose new servers died
        reaching its engine)."""
        latest: dict[bytes, object] = {}
        while True:
            try:
                identity, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                message = decode_node_message(frames)
            except MalformedMessage as exc:
                log.warning("ignoring a malformed message on the registration port: %s", exc)
                continue
            latest.pop(identity, None)  # (a dict keeps insertion order: each peer's place is its last message's)
            latest[identity] = message
        return list(latest.items())

    def _on_message(self, identity: bytes, message) -> None:
        if isinstance(message, NodeHello):
            self._on_hello(identity, message)
        elif isinstance(message, NodeLeaving):
            self._remember(self._left, message.node_id)
            self._drop_node(message.node_id, f"its node left: {message.reason}", RANK_NODE_LEFT)
        elif isinstance(message, NodeDraining):
            self._on_draining(identity, message)
        else:
            log.warning("ignoring a %s on the registration port", type(message).__name__)

    def _on_hello(self, identity: bytes, hello: NodeHello) -> None:
        if hello.node_id in self._left:
            return  # late: the node said it left (a node's id is new each run)
        refusal = self._refusal(hello)
        if refusal is not None:
            if not self._refused_before(hello):
                log.error("refused node %s (ranks %s): %s", hello.node_name, _ranks(hello.ranks), refusal)
            self._drop_node(hello.node_id, f"refused: {refusal}", RANK_NODE_LEFT)
            self._reply(identity, HelloRefused(refusal))
            return
        now = time.monotonic()
        if hello.head_id and hello.head_id != self.head_id and not self._holds_any(hello.node_id):
            log.info("node %s (ranks %s) registers again after a head restart: its engines kept their model",
                     hello.node_name, _ranks(hello.ranks))
        for rank, address in zip(hello.ranks, hello.addresses):
            held = self.ranks.get(rank)
            if held is None or held.node_id != hello.node_id or held.address != address:
                log.info("rank %d registered by node %s: engine at %s", rank, hello.node_name, address)
                self._events.append(RankJoined(rank, address, hello.node_name))
            self.ranks[rank] = _Registration(hello.node_id, hello.node_name, address, now, hello)
        self._reply(identity, HelloAccepted(self.head_id))

    def _on_draining(self, identity: bytes, draining: NodeDraining) -> None:
        held = [(rank, r) for rank, r in sorted(self.ranks.items()) if r.node_id == draining.node_id]
        if not held:
            return
        now = time.monotonic()
        for rank, registration in held:
            registration.last_seen = now
            if not registration.draining:
                registration.draining = True
                log.warning("rank %d draining (node %s: %s): no new requests go to it, the running ones finish",
                            rank, registration.node_name, draining.reason[:200])
                self._events.append(RankDraining(rank, registration.node_name))
        self._reply(identity, HelloAccepted(self.head_id))

    def _refusal(self, hello: NodeHello) -> str | None:
        """Why `hello` cannot be registered, in one line; None when it can."""
        size = self.layout.size
        if hello.data_parallel_size != size:
            return (f"the node says --data-parallel-size {hello.data_parallel_size}, the head's is {size}")
        if not hello.ranks or len(hello.ranks) != len(hello.addresses) or len(set(hello.ranks)) != len(hello.ranks):
            return "the node names no ranks, a rank twice, or not one address per rank"
        for rank, address in zip(hello.ranks, hello.addresses):
            if not 0 <= rank < size:
                return f"rank {rank} is out of range: --data-parallel-size {size} has ranks 0-{size - 1}"
            if rank in self.layout.local_ranks:
                return f"rank {rank} is one of the head's own ranks ({_ranks(self.layout.local_ranks)})"
            held = self.ranks.get(rank)
            if held is not None and held.node_id != hello.node_id:
                return f"rank {rank} is already registered by node {held.node_name} (engine at {held.address})"
            if not is_tcp(address):
                return f"rank {rank}'s engine address {address!r} is not tcp://"
        if hello.model_name != self.model_name:
            return f"the node serves model {hello.model_name!r}, the head serves {self.model_name!r}"
        model = self.model
        if model is not None and (hello.vocab_size, hello.max_model_len) != (model.vocab_size, model.max_model_len):
            return (f"the node's model has a vocabulary of {hello.vocab_size} and max_model_len {hello.max_model_len},"
                    f" the head's {model.vocab_size} and {model.max_model_len}")
        return None

    def _refused_before(self, hello: NodeHello) -> bool:
        """One error line per refused node, not one per beat (it exits on the refusal, but a beat may be queued)."""
        seen = hello.node_id in self._refused
        if not seen:
            self._remember(self._refused, hello.node_id)
        return seen

    @staticmethod
    def _remember(ids: dict[str, None], node_id: str) -> None:
        """Node ids come from the network: only the last REMEMBERED of a kind are kept."""
        ids[node_id] = None
        if len(ids) > REMEMBERED:
            del ids[next(iter(ids))]

    def _holds_any(self, node_id: str) -> bool:
        return any(r.node_id == node_id for r in self.ranks.values())

    def _drop_node(self, node_id: str, reason: str, why: int) -> None:
        for rank, held in sorted(self.ranks.items()):
            if held.node_id == node_id:
                del self.ranks[rank]
                # (a drained node's leave was planned: not an error)
                log.log(logging.WARNING if held.draining else logging.ERROR, "rank %d lost (node %s): %s", rank,
                        held.node_name, reason)
                self._events.append(RankLost(rank, reason, why, held.draining))

    def _check_silence(self) -> None:
        now = time.monotonic()
        silent = {r.node_id: r for r in self.ranks.values() if now - r.last_seen > self.silence}
        for node_id, held in silent.items():
            self._drop_node(node_id, f"no heartbeat from node {held.node_name} for {now - held.last_seen:.1f} s "
                            f"(--engine-ping-interval {self.silence:g})", RANK_NODE_SILENT)

    def _reply(self, identity: bytes, record) -> None:
        try:
            self._sock.send_multipart([identity, *encode_node_message(record)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer a node: %s", exc)


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks))
