"""Connections as hostile or unlucky clients hold them: out of file descriptors, idle, slow, or arriving
while the group drains. Raw sockets, so that every byte and every close is the test's own."""
import socket
import time

import httpx
import psutil

SIM = ("--model", "sim:10")


def address_of(server) -> tuple[str, int]:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    return host, int(port)


def accept_failure_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if "accept failed" in line or "out of file descriptors" in line]


def test_out_of_file_descriptors_pauses_accepting_then_serves_again(start_supervise):
    server = start_supervise(*SIM)
    api = server.child_titled("ApiServer_0")
    # A few descriptors left: the connections below exhaust them, the rest wait in the backlog.
    api.rlimit(psutil.RLIMIT_NOFILE, (api.num_fds() + 8, api.rlimit(psutil.RLIMIT_NOFILE)[1]))
    clients = [socket.create_connection(address_of(server)) for _ in range(40)]
    try:
        time.sleep(0.5)
        cpu_before = sum(api.cpu_times()[:2])
        time.sleep(3)
        cpu = sum(api.cpu_times()[:2]) - cpu_before
        failures = accept_failure_lines(server)
        assert failures, server.log()[-2000:]
        assert len(failures) <= 6, failures[:10]  # at most one report a second (3.5 s here)
        assert "out of file descriptors" in failures[-1]
        assert cpu < 0.6, f"{cpu:.2f} s of CPU in 3 s while out of file descriptors"
    finally:
        for client in clients:
            client.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.1)
