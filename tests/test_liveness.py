"""An API server stays alive and says how it is: a fast engine must not starve its event loop, and /health
follows the engine's answers to pings."""
import json
import socket
import time

import httpx

from tests.supervise_process import wait_for


def open_unread_stream(server, body: dict) -> socket.socket:
    """A streamed request whose reader never reads: the server's outputs pile up on its side."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(server.address)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return conn


def test_an_engine_flooding_outputs_does_not_starve_the_event_loop(start_supervise):
    # sim:1 with 4 x 128 sequences: some 500 outputs a millisecond, more than one API server can decode.
    # Its loop must still beat and answer /health; today one socket drain never ends and it is killed.
    server = start_supervise("--model", "sim:1", "--heartbeat-timeout", "3", "--max-num-seqs", "512")
    pid = server.child_titled("ApiServer_0").pid
    body = {"model": "sim:1", "prompt": "x", "max_tokens": 4000, "n": 128, "stream": True,
            "ignore_eos": True}
    streams = [open_unread_stream(server, body) for _ in range(4)]
    try:
        assert streams[0].recv(12) == b"HTTP/1.1 200"
        started = time.monotonic()
        slowest = 0.0
        while time.monotonic() - started < 6:
            asked = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.25)
        assert slowest < 1.0
        assert "has not beaten" not in server.log()
        assert server.child_titled("ApiServer_0").pid == pid
    finally:
        for conn in streams:
            conn.close()


def test_health_is_503_while_the_engine_misses_pings_and_200_once_it_answers(start_supervise):
    server = start_supervise("--model", "sim:10", "--engine-ping-interval", "1")
    engine = server.child_titled("EngineCore_DP0")
    engine.suspend()
    try:
        frozen_at = time.monotonic()
        r = server.wait_health(503, 5)  # one missed ping: at most two intervals
        assert time.monotonic() - frozen_at < 3.5
        assert "has not answered a ping" in r.json()["error"]["message"]
        assert httpx.get(f"{server.url}/ping", timeout=5).status_code == 503
    finally:
        engine.resume()
    server.wait_health(200, 3)
    assert httpx.get(f"{server.url}/ping", timeout=5).status_code == 200
    assert "died" not in server.log()


def test_a_frozen_engine_takes_the_group_down(start_supervise):
    """An engine that stops answering without exiting is killed by the supervisor, then handled as any engine's
    death: the group goes down (exit 1) instead of restarting API servers that wait on it forever."""
    server = start_supervise("--model", "sim:10", "--engine-ping-interval", "1", "--api-server-count", "2")
    server.child_titled("EngineCore_DP0").suspend()
    frozen_at = time.monotonic()
    assert server.wait_exit(30) == 1
    assert time.monotonic() - frozen_at < 15  # (3 + 2) intervals from the first ping unanswered, the 2 s grace, the stop
    log = server.log()
    assert "EngineCore_DP0 has answered no ping for" in log
    assert "an engine core is gone: taking the group down" in log
    assert "Traceback" not in log


def test_a_frozen_engine_is_restarted_with_on_engine_failure_restart(start_supervise):
    server = start_supervise("--model", "sim:10", "--engine-ping-interval", "1", "--on-engine-failure", "restart")
    engine = server.child_titled("EngineCore_DP0")
    engine.suspend()
    wait_for(lambda: server.log().count("serving ") >= 2, 60, "the group to serve again", server)
    r = httpx.post(f"{server.base_url}/completions", json={"model": "sim:10", "prompt": "a", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200
    assert server.child_titled("EngineCore_DP0").pid != engine.pid
    assert not engine.is_running()
