"""Streams over time: keep-alive comments, a disconnect reaching the engine, group-wide admission limits,
and in-flight streams finishing on SIGTERM."""
import concurrent.futures
import signal
import threading
import time

import httpx
import pytest

from tests.supervise_process import Supervise

HELLO = [{"role": "user", "content": "hello"}]


def long_stream(model: str, max_tokens: int = 2000) -> dict:
    return {"model": model, "messages": HELLO, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow():
    """A step every 100 ms, keep-alive comments after 30 ms of silence, development routes for engine stats."""
    with Supervise("--model", "sim:100", "--sse-keep-alive-interval", "0.03", env={"SUPERVISE_DEV_MODE": "1"}) as server:
        yield server


def test_keep_alive_comments_while_idle(slow):
    body = {"model": "sim:100", "messages": HELLO, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", f"{slow.base_url}/chat/completions", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert ": keep-alive" in lines
    assert lines[-1] == "data: [DONE]"
    data = [line for line in lines if line.startswith("data: {")]
    assert len(data) >= 4


def engine_stats(group) -> dict:
    return httpx.get(f"{group.url}/server_info", timeout=10).json()["engines"][0]


def test_disconnect_aborts_in_the_engine_within_a_step(slow):
    before = engine_stats(slow)["num_aborted"]
    with httpx.stream("POST", f"{slow.base_url}/chat/completions", json=long_stream("sim:100"), timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith('data: {"id'):
            pass
        assert engine_stats(slow)["num_running"] == 1
    closed = time.monotonic()
    while engine_stats(slow)["num_running"] and time.monotonic() - closed < 5:
        time.sleep(0.01)
    # Within a few steps of 100 ms (the abort needs one, the polling above one more; a loaded 2-core machine read
    # 216 ms once), not the 200 s the stream had left.
    assert time.monotonic() - closed < 0.5
    assert engine_stats(slow)["num_aborted"] == before + 1


def test_disconnect_of_a_whole_answer_request_aborts_too(slow):
    before = engine_stats(slow)["num_aborted"]
    body = {"model": "sim:100", "messages": HELLO, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.base_url}/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while engine_stats(slow)["num_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine_stats(slow)["num_aborted"] == before + 1


def test_admission_limits_hold_for_the_whole_group(start_supervise):
    group = start_supervise("--model", "sim:50", "--api-server-count", "4", "--max-num-queued-reqs", "3")
    admitted, refused = [], []
    release = threading.Event()

    def try_one(_):
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            with client.stream("POST", f"{group.base_url}/chat/completions", json=long_stream("sim:50")) as response:
                if response.status_code == 200:
                    admitted.append(1)
                    release.wait(30)
                else:
                    body = response.read()
                    refused.append((response.status_code, response.headers.get("retry-after"), body))

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(try_one, i) for i in range(12)]
        deadline = time.monotonic() + 20
        while len(admitted) + len(refused) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
        for future in futures:
            future.result()
    assert len(admitted) == 3
    assert len(refused) == 9
    for status, retry_after, body in refused:
        assert status == 503 and b'"overloaded_error"' in body and not body.startswith(b"data:")
        assert retry_after == "1"
    # Once they finished, there is room again.
    ok = httpx.post(f"{group.base_url}/chat/completions", json={"model": "sim:50", "messages": HELLO, "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200


def test_token_limit(start_supervise):
    group = start_supervise("--model", "sim:50", "--max-num-queued-tokens", "20")
    url = f"{group.base_url}/completions"

    def complete(prompt: list[int], **fields) -> httpx.Response:
        return httpx.post(url, json={"model": "sim:50", "prompt": prompt, "max_tokens": 1, **fields}, timeout=30)

    # More tokens than the group ever admits: the client's error, not a 503 that invites a retry.
    error = complete([100] * 21).json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "too_many_tokens" and "20" in error["message"]
    body = {"model": "sim:50", "prompt": [100] * 15, "stream": True, "max_tokens": 500, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=30) as held:
        lines = held.iter_lines()  # (kept: a dropped line iterator closes the stream)
        assert next(lines).startswith("data: ")
        refused = complete([100] * 10)  # fits the limit, not beside the 15 in flight: retry later
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"
        assert refused.headers["retry-after"] == "1"
    assert complete([100] * 10).status_code == 200


def test_sigterm_lets_streams_finish(start_supervise):
    group = start_supervise("--model", "sim:5", "--api-server-count", "2")
    threading.Timer(0.3, group.signal, (signal.SIGTERM,)).start()
    with httpx.stream("POST", f"{group.base_url}/chat/completions", json=long_stream("sim:5", 300), timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert sum(1 for line in lines if line.startswith("data: {")) > 100
    assert group.wait_exit(30) == 0
