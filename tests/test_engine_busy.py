"""A busy engine is not a dead one: the engine process answers pings and stats from its I/O thread while a long step
runs (the simulated engine's `sim-slow-step-<s>` hook), so one big prompt on a slow engine does not take the group
down; a step stuck past --engine-step-timeout (`sim-engine-hang`) silences them, and the API servers' missed-ping
logic takes the group down as for a frozen engine. SIGTERM still stops an engine whose step never ends."""
import threading
import time

import httpx
import pytest

from ipc.codec import encode
from ipc.messages import EngineOutputs, EngineRequest, UtilityCall, UtilityResult
from ipc.sampling import SamplingParams
from ipc.sockets import api_server_identity, connect_dealer
from tests.test_engine_process import _recv, _start_engine
from tests.test_group_lifecycle import model_of

STATS_KEYS = {"num_running", "num_waiting", "kv_cache_usage", "num_requests", "num_finished", "num_aborted",
              "num_failed"}


def post_in_background(server, request_id: str, max_tokens: int = 8) -> tuple[threading.Thread, dict]:
    """A chat completion with X-Request-Id `request_id`, sent from a thread: (the thread, {"status"/"error": ...})."""
    result: dict = {}
    body = {"model": model_of(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}

    def send():
        try:
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"X-Request-Id": request_id},
                           timeout=60)
            result["status"] = r.status_code
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, result


def group_pids(server) -> dict[str, int]:
    return {"supervisor": server.pid, **{title: server.child_titled(title).pid
                                         for title in ("EngineCore_DP0", "ApiServer_0")}}


def test_a_step_longer_than_three_ping_intervals_does_not_take_the_group_down(start_supervise):
    # 4 s of one step: 8 ping intervals of 0.5 s, where 3 unanswered pings in a row stop the API server.
    server = start_supervise("--model", "sim:10", "--engine-ping-interval", "0.5")
    before = group_pids(server)
    started = time.monotonic()
    thread, result = post_in_background(server, "sim-slow-step-4-big-prompt")
    health = []
    while thread.is_alive() and time.monotonic() - started < 30:
        try:
            health.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
        except httpx.HTTPError as exc:
            health.append(repr(exc))
        time.sleep(0.1)
    thread.join(30)
    took = time.monotonic() - started
    log = server.log()
    assert result == {"status": 200}, log[-3000:]
    assert took >= 3.5, f"the step took {took:.1f} s: the slow-step hook did not work"
    assert len(health) >= 20 and set(health) == {200}, (health, log[-3000:])
    assert group_pids(server) == before
    assert "missed" not in log and "died" not in log, log[-3000:]


def test_a_step_past_the_step_timeout_goes_silent_and_the_group_goes_down(start_supervise):
    server = start_supervise("--model", "sim:10", "--engine-ping-interval", "0.5", "--engine-step-timeout", "2",
                             "--max-restarts", "0")
    post_in_background(server, "sim-engine-hang-1")
    hung_at = time.monotonic()
    time.sleep(1.0)  # inside the step, well under the timeout: still answering
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200, server.log()[-3000:]
    r = server.wait_health(503, 10)  # past 2 s, then one missed ping
    assert "has not answered a ping" in r.json()["error"]["message"]
    assert time.monotonic() - hung_at >= 2.0
    assert server.wait_exit(30) == 1
    log = server.log()
    assert log.count("stopped answering pings") == 1, log[-3000:]
    assert "--engine-step-timeout" in log
    assert "missed 3 ping(s) in a row" in log and "ApiServer_0 died: exit code 3" in log


@pytest.fixture
def sim_engine(tmp_path_factory):
    """A bare simulated engine process (no supervisor, no API server) whose step times out after 1.5 s."""
    yield from _start_engine(tmp_path_factory, model="sim:5", engine_step_timeout=1.5)


def encode_call(call_id: int, method: str) -> list:
    return encode(UtilityCall(call_id, method))


def _ping(sock, call_id: int, timeout_s: float):
    sock.send_multipart(encode_call(call_id, "ping"))
    return _recv(sock, timeout_s)


def test_a_bare_engine_answers_ping_and_stats_during_a_long_step(sim_engine):
    _proc, _info, zctx, address = sim_engine
    sock = connect_dealer(zctx, address, api_server_identity(1))
    try:
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        sock.send_multipart(encode(EngineRequest("sim-slow-step-1.2-x", [1, 2, 3], sampling)))
        time.sleep(0.3)  # its first step has begun, and sleeps 1.2 s more
        asked = time.monotonic()
        assert _ping(sock, 1, 1.0) == UtilityResult(1, "pong")
        sock.send_multipart(encode_call(2, "stats"))
        stats = _recv(sock, 1.0)
        assert time.monotonic() - asked < 0.5
        assert isinstance(stats, UtilityResult) and STATS_KEYS <= set(stats.result), stats
        assert stats.result["num_running"] == 1 and stats.result["num_requests"] == 1
        tokens = []
        while not tokens or tokens[-1].finish_reason is None:
            msg = _recv(sock, 10)
            assert isinstance(msg, EngineOutputs), msg
            tokens += msg.outputs
        assert sum(len(o.new_token_ids) for o in tokens) == 3
        sock.send_multipart(encode_call(3, "stats"))
        after = _recv(sock, 1.0).result
        assert after["num_running"] == 0 and after["num_finished"] == 1
    finally:
        sock.close(linger=0)


def test_a_wedged_step_silences_pings_and_sigterm_still_stops_the_engine(sim_engine):
    proc, _info, zctx, address = sim_engine
    sock = connect_dealer(zctx, address, api_server_identity(2))
    try:
        sock.send_multipart(encode(EngineRequest("sim-engine-hang-x", [1, 2, 3], SamplingParams(max_tokens=3))))
        time.sleep(0.3)
        assert _ping(sock, 1, 1.0) == UtilityResult(1, "pong")  # inside the step, under the timeout
        time.sleep(1.5)  # past --engine-step-timeout
        sock.send_multipart(encode_call(2, "ping"))
        assert not sock.poll(1000), "a wedged engine still answers pings"
        proc.terminate()
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        sock.close(linger=0)
