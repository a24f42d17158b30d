"""The head and a headless node on two "machines": the node in its own network namespace, joined to the head's
by a veth pair, so they share no loopback: the registration, the engine traffic (CURVE) and the node's choice of
the address its engines listen on (its interface toward the head) all cross a real link. Needs root and
`ip netns`; skipped with the reason otherwise."""
import os
import random
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.dp_support import complete, deployment, dp_args, free_port, key_file, served_by_rank  # noqa: F401


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


@pytest.fixture
def veth_namespace():
    """(namespace name, head address, node address, the head's end of the link), removed after the test with its
    veth pair."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to make a network namespace and a veth pair")
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    namespace, outer, inner = f"dpns{tag}", f"dpva{tag}", f"dpvb{tag}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    head, node = f"{subnet}.1", f"{subnet}.2"
    made = _ip("netns", "add", namespace, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    try:
        for args in (["link", "add", outer, "type", "veth", "peer", "name", inner],
                     ["link", "set", inner, "netns", namespace],
                     ["addr", "add", f"{head}/30", "dev", outer], ["link", "set", outer, "up"],
                     ["-n", namespace, "addr", "add", f"{node}/30", "dev", inner],
                     ["-n", namespace, "link", "set", inner, "up"], ["-n", namespace, "link", "set", "lo", "up"]):
            done = _ip(*args, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair: ip {' '.join(args)}: {done.stderr.strip()}")
        yield namespace, head, node, outer
    finally:
        _ip("netns", "del", namespace, check=False)  # takes the veth pair with it
        _ip("link", "del", outer, check=False)


# veth_namespace first: its teardown (the namespace deleted) comes after the deployment's (the node stopped), since a
# node drains on SIGTERM, through its engines' addresses in the namespace.
def test_a_node_in_another_network_namespace_serves_through_the_veth_pair(veth_namespace, deployment, key_file):
    namespace, head_address, node_address, _ = veth_namespace
    rpc = free_port()
    common = ["--data-parallel-address", head_address, "--data-parallel-key-file", key_file]
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", *common), wait=False)
    engine_port = free_port()  # any port is free in a namespace that has just been made
    node = deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1", "--data-parallel-engine-port",
                                    str(engine_port), *common), prefix=["ip", "netns", "exec", namespace])
    head.wait_serving()
    engines = httpx.get(f"{head.url}/load", timeout=10).json()["engines"]
    # Its own side of the link (found alone: the route toward the head), on the port it was given.
    assert engines[1]["address"] == f"tcp://{node_address}:{engine_port}", engines
    assert f"registration port tcp://{head_address}:{rpc}" in head.log()
    for _ in range(2):
        assert complete(head.url, {"X-data-parallel-rank": "1"}).status_code == 200
    assert complete(head.url).status_code == 200
    assert served_by_rank(head.url)[1] >= 2
    # The node's engine really is on the other side: its own loopback cannot reach the head's.
    host, port = head.address
    connect = f"import socket; socket.create_connection(({host!r}, {port}), 2)"
    probe = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", connect],
                           capture_output=True, text=True, timeout=10)
    assert probe.returncode == 1 and "ConnectionRefusedError" in probe.stderr, probe.stderr
    assert node.proc.poll() is None


def test_a_stream_over_a_link_that_dropped_ends_with_an_error_not_a_hang_or_a_gap(veth_namespace, deployment,
                                                                                  key_file):
    """The link to the node goes down for 6 s, shorter than the node's heartbeats and the pings allow (60 s here):
    ZMQ drops the engine's connection after 3 s of silence and makes a new one once the link is back, and the
    outputs the engine wrote meanwhile are lost. A stream pinned there waited forever for its end, or ended as if
    whole with a gap in its text. Now it ends with an error event that says the connection dropped, and the rank
    serves the next request."""
    namespace, head_address, _, link = veth_namespace
    rpc = free_port()
    model = "sim:20"  # 600 tokens: 12 s of stream
    common = ["--data-parallel-address", head_address, "--data-parallel-key-file", key_file,
              "--engine-ping-interval", "60"]
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", *common, model=model), wait=False)
    deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1", "--data-parallel-engine-port",
                             str(free_port()), *common, model=model), prefix=["ip", "netns", "exec", namespace])
    head.wait_serving()
    body = {"model": model, "prompt": "hi", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{head.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "1"},
                      timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        events = [next(lines) for _ in range(5)]
        _ip("link", "set", link, "down")
        cut = time.monotonic()
        try:
            time.sleep(6)
        finally:
            _ip("link", "set", link, "up")
        events += list(lines)
    assert events[-1] == "data: [DONE]", events[-3:]
    assert '"error"' in events[-2] and "the connection to engine core DP1 dropped" in events[-2], events[-3:]
    assert time.monotonic() - cut < 20
    assert "the connection to engine core DP1" in head.log()
    deadline = time.monotonic() + 30
    while True:  # the connection is made again within a second or so of the link's return
        answer = httpx.post(f"{head.url}/v1/completions", headers={"X-data-parallel-rank": "1"}, timeout=30,
                            json={"model": model, "prompt": "hi", "max_tokens": 3})
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
