"""Faults that must not wedge the group or leak its work: a server killed inside admission, the requests of a
dead server, the port during a drain, and what the supervisor says about the servers it kills itself."""
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from apiserver.admission import TEST_PAUSE_ENV
from tests.supervise_process import SUPERVISE, wait_for
from tests.test_group_lifecycle import SIM, model_of, start_long_requests


class HeldStreams:
    """Streaming requests sent at once, each held open (unread) until `release`, so every request that was
    admitted is still admitted when the last one is decided: the count of 200s is the most admitted at once."""

    def __init__(self, url: str, model: str, count: int, max_tokens: int):
        self.statuses: list[int | str] = []
        self._release = threading.Event()
        body = {"model": model, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._threads = [threading.Thread(target=self._one, args=(url, body), daemon=True) for _ in range(count)]
        for t in self._threads:
            t.start()

    def _one(self, url: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=20) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
                self.statuses.append(r.status_code)
                self._release.wait(60)
        except httpx.HTTPError as exc:
            self.statuses.append(type(exc).__name__)

    def wait_decided(self, timeout: float) -> list:
        wait_for(lambda: len(self.statuses) == len(self._threads), timeout, f"{len(self._threads)} answers")
        return list(self.statuses)

    def release(self) -> None:
        self._release.set()
        for t in self._threads:
            t.join(30)


def test_a_server_killed_inside_admission_wedges_nobody_and_the_limit_holds(start_supervise):
    # The test hook makes every admission pause 1 s between counting the request in and checking the group's
    # totals. With the old group lock, a server killed there held the lock forever: nobody was admitted again.
    limit = 4
    server = start_supervise(*SIM, "--api-server-count", "3", "--max-num-queued-reqs", str(limit),
                             env={TEST_PAUSE_ENV: "1"})
    model = model_of(server)
    victim_request = HeldStreams(server.url, model, 1, max_tokens=2000)
    paused = wait_for(lambda: re.search(r"\[(ApiServer_\d+)\].*test hook: pausing", server.log()), 10,
                      "a server paused inside admission", server)
    server.child_titled(paused.group(1)).kill()
    victim_request.release()
    wait_for(lambda: f"{paused.group(1)} ready" in server.log(), 30, "its replacement", server)

    streams = HeldStreams(server.url, model, 12, max_tokens=2000)  # 20 s each at sim:10: none ends meanwhile
    try:
        statuses = streams.wait_decided(45)
    finally:
        streams.release()
    assert set(statuses) <= {200, 503}, statuses
    assert 1 <= statuses.count(200) <= limit, statuses
    # Every slot was given back: the group admits again, up to its limit.
    again = HeldStreams(server.url, model, 1, max_tokens=5)
    assert wait_for(lambda: again.statuses, 20, "an answer") == [200]
    again.release()


def test_the_engines_drop_the_requests_of_a_killed_api_server(start_supervise):
    server = start_supervise(*SIM, "--api-server-count", "1", env={"SUPERVISE_DEV_MODE": "1"})
    model = model_of(server)

    def engine_running() -> int | None:
        try:
            return httpx.get(f"{server.url}/server_info", timeout=5).json()["engines"][0]["num_running"]
        except (httpx.HTTPError, KeyError, ValueError):
            return None  # between the kill and the replacement

    streams = HeldStreams(server.url, model, 20, max_tokens=5000)  # 50 s each at sim:10
    try:
        assert streams.wait_decided(30) == [200] * 20
        wait_for(lambda: engine_running() == 20, 10, "20 running requests", server)
        server.child_titled("ApiServer_0").kill()
        killed_at = time.monotonic()
        wait_for(lambda: engine_running() == 0, 10, "the engine to drop them", server)
        assert time.monotonic() - killed_at < 10
    finally:
        streams.release()
    assert "EngineCore_DP0 aborted 20 request(s) of api-0" in server.log()


def supervisor_listens_on(pid: int, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections(kind="tcp"))


def test_sigterm_closes_the_supervisors_listening_socket_at_once(start_supervise):
    server = start_supervise(*SIM, "--shutdown-timeout", "60")
    port = int(server.url.rsplit(":", 1)[1])
    start_long_requests(server, 1)  # 50 s: the drain goes on
    time.sleep(0.5)
    assert supervisor_listens_on(server.pid, port)
    server.signal(signal.SIGTERM)
    wait_for(lambda: not supervisor_listens_on(server.pid, port), 3, "the supervisor to close the port", server)
    assert server.proc.poll() is None  # still draining


# Both halves of issue 10.9: the supervisor closes its copy of the socket when the drain starts, and each API
# server closes its own (apiserver/accept_loop.py); while either holds it, connections queue in the backlog.
def test_new_connections_are_refused_at_once_during_the_drain(start_supervise):
    server = start_supervise(*SIM, "--api-server-count", "2", "--shutdown-timeout", "60")
    port = int(server.url.rsplit(":", 1)[1])
    start_long_requests(server, 2)
    time.sleep(0.5)
    server.signal(signal.SIGTERM)
    time.sleep(1.0)
    assert server.proc.poll() is None  # still draining
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert time.monotonic() - started < 1.0


def test_a_heartbeat_kill_is_logged_once_with_its_reason(start_supervise):
    server = start_supervise(*SIM, "--heartbeat-timeout", "2")
    frozen = server.child_titled("ApiServer_0")
    frozen.suspend()
    try:
        wait_for(lambda: "ApiServer_0 ready" in server.log(), 30, "the replacement", server)
    finally:
        try:
            frozen.resume()
        except psutil.NoSuchProcess:
            pass
    log = server.log()
    assert log.count("ApiServer_0 has not beaten") == 1, log[-3000:]
    assert "ApiServer_0 died: killed by SIGKILL (by the supervisor: its event loop was silent for" in log
    assert "perhaps out of memory" not in log


def test_an_api_server_start_up_timeout_names_its_option():
    result = subprocess.run([SUPERVISE, "--port", "0", *SIM, "--api-server-ready-timeout", "0.2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "ApiServer_0 not ready after 0.2 s (--api-server-ready-timeout)" in result.stdout + result.stderr
