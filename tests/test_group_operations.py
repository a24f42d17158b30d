"""What operators do to a live group: reload, scale, socket activation, engine restarts in place."""
import os
import re
import signal
import socket
import subprocess
import time

import httpx

from tests.load import BackgroundLoad
from tests.supervise_process import SUPERVISE, title_of, wait_for, wait_gone

SIM = ("--model", "sim:10")


def model_of(server) -> str:
    return httpx.get(f"{server.base_url}/models").json()["data"][0]["id"]


def api_server_pids(server) -> set[int]:
    return {c.pid for c in server.children() if "ApiServer_" in title_of(c)}


def test_sighup_rolls_every_api_server_without_a_failed_request(start_supervise):
    server = start_supervise(*SIM, "--api-server-count", "2")
    before = api_server_pids(server)
    with BackgroundLoad(server.url, model_of(server), clients=4, max_tokens=30) as load:
        load.wait_for(8)
        server.signal(signal.SIGHUP)
        wait_for(lambda: "rolling restart done" in server.log(), 60, "the rolling restart", server)
        wait_for(lambda: not (api_server_pids(server) & before), 30, "the old servers to exit", server)
        done_at_restart = load.ok
        load.wait_for(done_at_restart + 8)
    assert load.failures == []
    assert load.ok > done_at_restart
    after = api_server_pids(server)
    assert len(after) == 2 and not (after & before)


def test_sigttin_adds_and_sigttou_removes_an_api_server(start_supervise):
    server = start_supervise(*SIM, "--api-server-count", "2")
    server.signal(signal.SIGTTIN)
    wait_for(lambda: len(api_server_pids(server)) == 3 and "ApiServer_2 ready" in server.log(), 30,
               "a third server", server)
    server.signal(signal.SIGTTOU)
    wait_for(lambda: len(api_server_pids(server)) == 2 and "ApiServer_2 drained and stopped" in server.log(), 30,
               "back to two servers", server)
    assert httpx.post(f"{server.base_url}/completions",
                      json={"model": model_of(server), "prompt": "a", "max_tokens": 2}).status_code == 200


def test_every_log_line_names_its_process(start_supervise):
    server = start_supervise(*SIM, "--api-server-count", "2")
    server.signal(signal.SIGTERM)
    server.wait_exit(30)
    tagged = re.compile(r"\[(supervisor|ApiServer_\d+|EngineCore_DP\d+)\]")
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert {m.group(1) for line in lines if (m := tagged.search(line))} >= {
        "supervisor", "ApiServer_0", "ApiServer_1", "EngineCore_DP0"
    }
    untagged = [line for line in lines if not tagged.search(line)]
    assert untagged == []


def test_a_server_frozen_while_it_drains_is_killed_by_its_heartbeat(start_supervise):
    """SIGSTOP then SIGTTOU (or a SIGHUP's roll): the draining server was left out of the heartbeat check, and held
    its requests, admission slots and copy of the port for as long as it stayed frozen; the group's stop then
    waited --shutdown-timeout for it."""
    server = start_supervise(*SIM, "--api-server-count", "2", "--heartbeat-timeout", "2")
    (frozen,) = [c for c in server.children() if title_of(c) == "supervise: ApiServer_1"]
    frozen.suspend()
    server.signal(signal.SIGTTOU)  # drains the highest index: the frozen one
    wait_for(lambda: "ApiServer_1 has not beaten for" in server.log(), 10, "the heartbeat check", server)
    assert wait_gone([frozen], 5) == []
    assert "while it drained: killing it" in server.log()
    assert httpx.post(f"{server.base_url}/completions",
                      json={"model": model_of(server), "prompt": "a", "max_tokens": 2}).status_code == 200
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0 and time.monotonic() - started < 10


def test_the_stop_does_not_wait_for_a_frozen_server(start_supervise):
    """SIGTERM with an API server SIGSTOPped: the stop waited --shutdown-timeout + 5 s (35 s) for it, new connections
    hanging meanwhile; it is killed at --heartbeat-timeout, as the watchdog would."""
    server = start_supervise(*SIM, "--api-server-count", "2", "--heartbeat-timeout", "2")
    (frozen,) = [c for c in server.children() if title_of(c) == "supervise: ApiServer_0"]
    frozen.suspend()
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    assert server.wait_exit(20) == 0 and time.monotonic() - started < 10
    assert "ApiServer_0 has not beaten for" in server.log() and "while the group stops: killing it" in server.log()


def test_engine_failure_restart_keeps_the_port_serves_again_and_gives_up_past_its_budget(start_supervise):
    server = start_supervise(*SIM, "--on-engine-failure", "restart", "--max-engine-restarts", "1")
    model = model_of(server)
    engine = server.child_titled("EngineCore_DP0")
    engine.kill()
    wait_for(lambda: server.log().count("serving ") >= 2, 60, "the group to serve again", server)
    assert server.proc.poll() is None
    r = httpx.post(f"{server.base_url}/completions", json={"model": model, "prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    again = server.child_titled("EngineCore_DP0")
    assert again.pid != engine.pid
    # An engine that keeps dying (or a request that kills it each time a client retries) must not keep the group
    # loading forever: past --max-engine-restarts the group goes down, and its service manager decides.
    again.kill()
    assert server.wait_exit(30) == 1, server.log()[-3000:]
    assert "1 group restart(s) within 600 s already (--max-engine-restarts" in server.log()
    assert server.log().count("serving ") == 2
    with socket.socket() as probe:
        assert probe.connect_ex(server.address) != 0


def test_a_stop_signal_during_an_engine_failure_restart_stops_the_group(start_supervise):
    """The restart drains the API servers first, here held by a stream on the rank that lives on. A SIGTERM
    then was taken for a hurry: the drain was cut short and the new group served on, while systemd waited."""
    server = start_supervise("--model", "sim:20", "--data-parallel-size", "2", "--on-engine-failure", "restart")
    body = {"model": "sim:20", "prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    stream = httpx.stream("POST", f"{server.base_url}/completions", json=body,
                          headers={"X-data-parallel-rank": "1"}, timeout=30)
    with stream as response:
        next(response.iter_lines())  # the stream runs
        server.child_titled("EngineCore_DP0").kill()
        wait_for(lambda: "restarting the whole group" in server.log(), 30, "the restart", server)
        server.signal(signal.SIGTERM)
        assert server.wait_exit(20) == 0, server.log()[-3000:]
    log = server.log()
    assert "the group stays down" in log
    assert log.count("serving ") == 1 and "restarting the group in place" not in log
    with socket.socket() as probe:  # nothing listens any more
        assert probe.connect_ex(server.address) != 0


def test_socket_activation_adopts_the_passed_socket(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    fd = listener.fileno()
    log = open(tmp_path / "log", "w+")
    # systemd's protocol: the socket is fd 3, LISTEN_FDS counts, LISTEN_PID names the process meant.
    proc = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" "$@"', SUPERVISE, *SIM, "--port", "1"],
        preexec_fn=lambda: os.dup2(fd, 3), close_fds=False, stdout=log, stderr=subprocess.STDOUT,
    )
    listener.close()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.2)
        children = [c for c in __import__("psutil").Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert wait_gone(children, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
