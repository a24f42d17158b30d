"""An API server's grammar checker (apiserver/grammar_checker.py) against grammars that would stall or crash its
event loop: the slow one is refused at --structured-output-check-timeout while the server answers everyone else,
the one that crashes the checker is refused (once by the crash, then by the verdict kept), and the checker comes
back for the next grammar."""
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

from tests.hostile_grammars import ref_chain, slow_gbnf
from tests.supervise_process import title_of


def _chat(http: httpx.Client, **extra) -> httpx.Response:
    body = {"model": "sim:1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return http.post("/v1/chat/completions", json=body)


def test_a_slow_grammar_is_refused_at_the_timeout_while_the_server_serves_on(start_supervise):
    server = start_supervise("--model", "sim:1", "--structured-output-check-timeout", "1")
    slowest_health = []

    def poll_health(stop: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not stop.is_set():
                started = time.monotonic()
                assert http.get("/health").status_code == 200
                slowest_health.append(time.monotonic() - started)
                time.sleep(0.05)

    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _chat(http, structured_outputs={"regex": "[a-z]+"}).status_code == 200  # the checker is up
        stop = threading.Event()
        poller = threading.Thread(target=poll_health, args=(stop,))
        poller.start()
        started = time.monotonic()
        # Seconds of Python in the GBNF converter, all of it in the event loop before.
        response = _chat(http, structured_outputs={"grammar": slow_gbnf()})
        took = time.monotonic() - started
        stop.set()
        poller.join()
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "--structured-output-check-timeout" in error["message"] and error["param"] == "structured_outputs.grammar"
        assert took < 8, took
        assert len(slowest_health) >= 5 and max(slowest_health) < 1.0, slowest_health
        # The killed checker is started again for the next grammar.
        assert _chat(http, structured_outputs={"choice": ["yes", "no"]}).status_code == 200
        for _ in range(3):
            response = _chat(http, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "x", "schema": ref_chain(1000)}})
            assert response.status_code == 400 and "crashed" in response.json()["error"]["message"], response.text
        assert _chat(http, structured_outputs={"choice": ["yes", "no"]}).status_code == 200
    assert server.log().count("the grammar checker died") == 1, server.log()
    checkers = [p for p in server.children() if title_of(p) == "supervise: GrammarChecker_0"]
    assert len(checkers) == 1 and checkers[0].status() != psutil.STATUS_ZOMBIE


# Run in a fresh interpreter: an after-fork hook cannot be unregistered, and this one must see only the checker.
_FORK_WITNESS = r"""
import asyncio, os, sys
import uvloop
from apiserver.grammar_checker import GrammarChecker

os.register_at_fork(after_in_child=lambda: os.write(2, b"FORKED-COPY-RAN-PYTHON\n"))


async def main():
    checker = GrammarChecker("supervise: GrammarChecker_test", timeout=30)
    grammar = await checker.build("regex", "[a-z]+")
    await checker.close()  # killed, and started again for the next
    await checker.check(grammar)
    await checker.close()
    print("BUILT" if grammar else "NOTHING")

uvloop.run(main())
"""


def test_the_checker_process_is_started_without_running_python_in_a_fork_of_the_server():
    """uvloop's subprocess start forks the API server and runs Python's after-fork code in the copy before exec; in
    a gRPC API server with gRPC's poller threads at work the copy crashed there (SIGSEGV, or SIGABRT in gRPC's
    epoll poller) in 3-5 starts of 300 (bench/checker_start.py), and that call failed INTERNAL through the gateway.
    The checker must be started with nothing run between fork and exec: an after-fork hook must not run."""
    run = subprocess.run([sys.executable, "-c", _FORK_WITNESS], capture_output=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().strip() == "BUILT", run.stdout
    assert b"FORKED-COPY-RAN-PYTHON" not in run.stderr, run.stderr.decode()[-2000:]


def test_out_of_file_descriptors_a_grammar_is_503_to_retry_and_served_once_they_are_back(start_supervise):
    """The checker's process needs descriptors for its pipes: a server out of them (a client holding connections
    open) answered a grammar with a bare 500 and a traceback. Now: 503 saying why, Retry-After, and the next
    grammar once descriptors are free is served, with its checker started then."""
    server = start_supervise("--model", "sim:1")
    api = server.child_titled("ApiServer_0")
    limits = api.rlimit(psutil.RLIMIT_NOFILE)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert _chat(http).status_code == 200  # this connection is open before the descriptors run out
        api.rlimit(psutil.RLIMIT_NOFILE, (api.num_fds() + 4, limits[1]))
        hogs = [socket.create_connection(server.address) for _ in range(20)]
        try:
            time.sleep(0.5)  # accepted until none is left
            response = _chat(http, structured_outputs={"regex": "[a-z]+"})
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["type"] == "service_unavailable_error", error
            assert "grammar checker could not be started" in error["message"], error
        finally:
            for hog in hogs:
                hog.close()
            api.rlimit(psutil.RLIMIT_NOFILE, limits)
        response = _chat(http, structured_outputs={"regex": "[a-z]+"})
        assert response.status_code == 200, response.text
    assert "Traceback" not in server.log(), server.log()[-3000:]


def _schema(i: int) -> dict:
    """A small JSON schema of its own for each `i`: a grammar the checker has not seen."""
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "string"}}, "required": [f"field_{i}"]}}}


def _in_thread(target, *args) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(target(*args)))
    thread.start()
    return thread, results


def test_another_clients_slow_grammar_does_not_hold_the_grammars_behind_it(start_supervise):
    """One checker did one grammar at a time: a request with a small new schema waited behind another client's
    grammar until that one's timeout (four such clients: 20 s, bench/grammar_contention.py). Now a second checker
    starts for it and answers while the slow one is still being checked."""
    server = start_supervise("--model", "sim:1", "--structured-output-check-timeout", "6")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _chat(http, response_format=_schema(0)).status_code == 200  # the first checker is up

        def slow() -> tuple[int, float]:
            with httpx.Client(base_url=server.url, timeout=60) as own:
                response = _chat(own, structured_outputs={"grammar": slow_gbnf()})
                return response.status_code, time.monotonic()

        thread, slow_result = _in_thread(slow)
        time.sleep(0.5)  # at the checker
        statuses = [_chat(http, response_format=_schema(i)).status_code for i in range(1, 4)]
        answered = time.monotonic()
        checkers = [p for p in server.children() if title_of(p) == "supervise: GrammarChecker_0"]
        thread.join()
    assert statuses == [200, 200, 200]
    slow_status, slow_answered = slow_result[0]
    assert slow_status == 400 and answered < slow_answered, (answered, slow_answered)
    assert len(checkers) == 2, checkers  # the slow one's (killed at its timeout since) and the one that served


def test_a_grammar_behind_others_in_line_past_the_timeout_is_503_to_retry(start_supervise):
    """With every checker busy on grammars that run to the timeout, a request waited in line for as long as the
    line was. Now the next in line waits for the next free checker and is served; one behind it waits at most the
    timeout, then gets 503 with Retry-After; a later one is served."""
    server = start_supervise("--model", "sim:1", "--structured-output-checkers", "1",
                             "--structured-output-check-timeout", "2")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _chat(http, response_format=_schema(0)).status_code == 200

        def slow(i: int) -> int:
            with httpx.Client(base_url=server.url, timeout=60) as own:
                return _chat(own, structured_outputs={"grammar": slow_gbnf(str(i))}).status_code

        slow_ones = []
        for i in range(3):  # one at the checker until 2 s, the next there from then on, the third next in line
            slow_ones.append(_in_thread(slow, i))
            time.sleep(0.3)
        started = time.monotonic()
        response = _chat(http, response_format=_schema(1))
        waited = time.monotonic() - started
        for thread, _ in slow_ones:
            thread.join()
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "service_unavailable_error" and "busy" in error["message"], error
        assert 1.9 < waited < 3.5, waited  # its own wait, not the line's (the last slow one ends after 6 s)
        assert [status for _, result in slow_ones for status in result] == [400, 400, 400]
        assert _chat(http, response_format=_schema(1)).status_code == 200
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_requests_for_a_grammar_being_checked_wait_for_that_check(start_supervise):
    """Eight clients sending the same new grammar at once were checked one after another, each to the timeout for a
    slow grammar (16 s here, or 503s now that the wait is bounded); now they share the one check."""
    server = start_supervise("--model", "sim:1", "--structured-output-checkers", "1",
                             "--structured-output-check-timeout", "2")
    grammar = slow_gbnf()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert _chat(http, response_format=_schema(0)).status_code == 200  # the checker is up: its start not timed

    def send() -> int:
        with httpx.Client(base_url=server.url, timeout=60) as own:
            return _chat(own, structured_outputs={"grammar": grammar}).status_code

    started = time.monotonic()
    threads = [_in_thread(send) for _ in range(8)]
    for thread, _ in threads:
        thread.join()
    took = time.monotonic() - started
    assert [status for _, result in threads for status in result] == [400] * 8
    assert took < 2 + 2.5, took  # one check to the timeout, not eight one after another
