"""The head and a headless node on two "machines": the node in its own network namespace, joined to the head's
by a veth pair, so they share no loopback: the registration, the engine traffic (CURVE) and the node's choice of
the address its engines listen on (its interface toward the head) all cross a real link. Needs root and
`ip netns`; skipped with the reason otherwise."""
import os
import random
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.dp_support import complete, deployment, dp_args, free_port, key_file, served_by_rank  # noqa: F401


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


@pytest.fixture
def veth_namespace():
    """(namespace name, head address, node address), removed after the test with its veth pair."""
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
        yield namespace, head, node
    finally:
        _ip("netns", "del", namespace, check=False)  # takes the veth pair with it
        _ip("link", "del", outer, check=False)


def test_a_node_in_another_network_namespace_serves_through_the_veth_pair(deployment, key_file, veth_namespace):
    namespace, head_address, node_address = veth_namespace
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
