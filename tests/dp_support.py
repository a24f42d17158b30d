"""Data-parallel deployments for tests: a head (a `supervise` with API servers), headless nodes, their key.

Everything is the real `supervise` command on 127.0.0.1 (or in a network namespace: `prefix`), each node with
its own log, stopped and checked for leftovers by the fixtures.
"""
from __future__ import annotations

import re
import secrets
import socket

import httpx
import pytest
import zmq

from ipc.registration import decode_node_message, encode_node_message

from tests.supervise_process import Supervise, wait_for

SIM_MODEL = "sim:10"
PING = "1"  # --engine-ping-interval in these tests: a lost node is noticed within a second


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_args(size: int, rpc_port: int, *extra: str, model: str = SIM_MODEL) -> list[str]:
    return ["--model", model, "--data-parallel-size", str(size), "--data-parallel-rpc-port", str(rpc_port),
            "--engine-ping-interval", PING, *extra]


class Node(Supervise):
    """`supervise --headless ...`: ready once it logged that the head accepted it."""

    def __init__(self, *args: str, env: dict | None = None, prefix: list[str] = ()):
        super().__init__("--headless", *args, env=env, prefix=prefix)

    def wait_registered(self, timeout: float = 60.0, times: int = 1) -> "Node":
        wait_for(lambda: self.log().count("registered with ") >= times or self.proc.poll() is not None,
                 timeout, "the node to register", self)
        assert self.proc.poll() is None, f"the node exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
        return self

    def engine_pids(self) -> dict[int, int]:
        """rank -> pid of this node's engine cores."""
        pids = {}
        for child in self.children():
            match = re.search(r"EngineCore_DP(\d+)", " ".join(child.cmdline()))
            if match:
                pids[int(match.group(1))] = child.pid
        return pids


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "dp.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def deployment():
    """deployment.head(*args) / deployment.node(*args): started now, all stopped after the test."""
    started: list[Supervise] = []

    class Deployment:
        @staticmethod
        def head(*args: str, wait: bool = True, env: dict | None = None) -> Supervise:
            head = Supervise(*args, env=env)
            started.append(head)
            return head.wait_serving() if wait else head

        @staticmethod
        def node(*args: str, wait: bool = True, env: dict | None = None, prefix: list[str] = ()) -> Node:
            node = Node(*args, env=env, prefix=prefix)
            started.append(node)
            return node.wait_registered() if wait else node

        @staticmethod
        def head_and_node(*head_extra: str) -> tuple[Supervise, Node, int]:
            """A head serving rank 0 (with `head_extra`) and a node with rank 1, both serving; and the head's
            registration port."""
            rpc = free_port()
            head = Deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", *head_extra), wait=False)
            node = Deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1"))
            head.wait_serving()
            return head, node, rpc

    yield Deployment
    for process in reversed(started):
        process.stop()


def raw_node_message(rpc: int, record, wait_ms: int = 5000):
    """What the head's registration port answers a hand-made message (a buggy or hostile node), None if nothing
    within `wait_ms`."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket a failed test leaves open never blocks term() in GC
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{rpc}")
        sock.send_multipart(encode_node_message(record))
        return decode_node_message(sock.recv_multipart()) if sock.poll(wait_ms) else None
    finally:
        sock.close(0)
        ctx.term()


def served_by_rank(url: str) -> dict[int, int]:
    """supervise_engine_requests_total per rank, from the group's /metrics."""
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'supervise_engine_requests_total\{.*engine="(\d+)"\} (\S+)', line)
        if match:
            counts[int(match.group(1))] = int(float(match.group(2)))
    return counts


def complete(url: str, headers: dict | None = None, max_tokens: int = 3, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                      json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": max_tokens, **body})
