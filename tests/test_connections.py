"""Connections as hostile or unlucky clients hold them: out of file descriptors, idle, slow, or arriving
while the group drains. Raw sockets, so that every byte and every close is the test's own."""
import json
import os
import re
import signal
import socket
import sys
import threading
import time

import httpx
import psutil
import pytest

from apiserver.metrics import Metrics
from tests.supervise_process import Supervise
from tests.test_api_request_path import metric

SIM = ("--model", "sim:10")


def accept_failure_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if "accept failed" in line or "out of file descriptors" in line]


def test_out_of_file_descriptors_pauses_accepting_then_serves_again(start_supervise):
    server = start_supervise(*SIM)
    api = server.child_titled("ApiServer_0")
    # A few descriptors left: the connections below exhaust them, the rest wait in the backlog.
    api.rlimit(psutil.RLIMIT_NOFILE, (api.num_fds() + 8, api.rlimit(psutil.RLIMIT_NOFILE)[1]))
    clients = [socket.create_connection(server.address) for _ in range(40)]
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
    server.wait_health(200, 5)


def under_open_files_limit(soft: int, hard: int) -> list[str]:
    """A command prefix that runs the rest under these RLIMIT_NOFILE limits (a shell's `ulimit -n`)."""
    code = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (%d, %d)); "
            "os.execv(sys.argv[1], sys.argv[1:])" % (soft, hard))
    return [sys.executable, "-c", code]


def test_a_low_open_files_limit_is_raised_to_the_hard_one_for_the_whole_group(start_supervise):
    """A shell's soft limit of 256 would cap an API server near 250 connections: it gets the hard limit (2048),
    the log says so, and warns that 2048 is still low. 600 connections at once are all answered."""
    # Kept alive longer than a client waits (10 s): a descriptor the server lacks is not freed by a timeout.
    server = start_supervise(*SIM, "--timeout-keep-alive", "30", prefix=under_open_files_limit(256, 2048))
    for child in server.children():
        assert child.rlimit(psutil.RLIMIT_NOFILE) == (2048, 2048), child.name()
    assert "open-files limit raised from 256 to 2048" in server.log()
    assert "open-files limit 2048 (hard limit 2048)" in server.log()
    clients = [connect(server) for _ in range(600)]
    try:
        for client in clients:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for client in clients:
            assert client.recv(100).startswith(b"HTTP/1.1 200 ")
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def short_timeouts():
    """One group with a 1 s keep-alive, a 2 s request read timeout and 48 KB of headers, shared by the timeout
    tests."""
    with Supervise(*SIM, "--timeout-keep-alive", "1", "--timeout-request-header", "2",
                   "--max-request-header-bytes", str(48 * 1024)) as server:
        yield server


def connect(server) -> socket.socket:
    conn = socket.create_connection(server.address)
    conn.settimeout(10)
    return conn


def read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (monotonic) it closed."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data, time.monotonic()


def read_responses(conn: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """`count` whole responses with Content-Length bodies, answers to pipelined requests: (head, body) each."""
    data, responses = b"", []
    while len(responses) < count:
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, data = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(data) < length:
            data += conn.recv(65536)
        responses.append((head, data[:length]))
        data = data[length:]
    return responses


def read_response(conn: socket.socket) -> bytes:
    """One whole response with a Content-Length body, from a connection that stays open."""
    ((head, body),) = read_responses(conn, 1)
    return head + b"\r\n\r\n" + body


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_idle_connections_are_closed_after_the_keep_alive_timeout(short_timeouts):
    fresh = connect(short_timeouts)  # never sends a byte
    used = connect(short_timeouts)
    used.sendall(HEALTH)
    assert read_response(used).startswith(b"HTTP/1.1 200")
    idle_from = time.monotonic()
    for conn in (fresh, used):
        data, closed_at = read_until_closed(conn)
        assert data == b""  # closed without a word
        assert 0.5 < closed_at - idle_from < 3.5
        conn.close()


def count_4xx(server) -> float:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        return metric(http, 'supervise_http_requests_total{model_name="sim:10",status="4xx"}')


def test_headers_sent_a_byte_a_second_get_408_then_close(short_timeouts):
    answered_before = count_4xx(short_timeouts)
    conn = connect(short_timeouts)
    started = time.monotonic()
    answer = b""
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 20:
            conn.sendall(bytes([byte]))
            conn.settimeout(0.5)
            try:
                answer = conn.recv(65536)
                break
            except socket.timeout:
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    conn.settimeout(10)
    data, closed_at = read_until_closed(conn) if answer else (b"", time.monotonic())
    answer += data
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"error"' in answer and b"connection: close" in answer.lower()
    assert 1.5 < closed_at - started < 5
    conn.close()
    assert count_4xx(short_timeouts) == answered_before + 1  # the connection's own answer is counted too


def test_headers_past_the_limit_get_431_then_close_and_smaller_ones_are_served(short_timeouts):
    """httptools has no limit of its own: 8 MB of headers (600,000 of them) were read, kept and answered. The
    group here takes 48 KB (--max-request-header-bytes)."""
    answered_before = count_4xx(short_timeouts)
    big = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 100) for i in range(700))  # 75 KB
    conn = connect(short_timeouts)
    try:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer, _ = read_until_closed(conn)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"request_headers_too_large"' in answer and b"connection: close" in answer.lower()
    assert b"49,152 bytes" in answer
    assert count_4xx(short_timeouts) == answered_before + 1
    conn = connect(short_timeouts)
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + big[: 40 * 1024].rsplit(b"\r\n", 1)[0] + b"\r\n\r\n")
    assert read_response(conn).startswith(b"HTTP/1.1 200")
    conn.close()


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ",
    b"GET /health?",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: ",
], ids=["one header value", "URL", "a chunked body's trailer"])
def test_a_head_that_never_ends_gets_431_as_soon_as_it_passes_the_limit(short_timeouts, head):
    """httptools joins the pieces of one header line (uvicorn those of the URL) until the line ends: a 64 MB header
    value sent in 64 KB pieces was 14.8 s of copying in the API server, its /health late by up to 3.5 s, and no
    answer until the header timeout. Now the reads of a head still incomplete are counted: 431 once they pass
    the limit, and the client, still sending, reads it."""
    answered_before = count_4xx(short_timeouts)
    conn = connect(short_timeouts)
    sent = 0
    try:
        conn.sendall(head)
        while sent < 32 * 2**20:
            conn.sendall(b"a" * 65536)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer, _ = read_until_closed(conn)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 431"), (answer[:200], sent)
    assert b'"request_headers_too_large"' in answer and b"49,152 bytes" in answer
    assert count_4xx(short_timeouts) == answered_before + 1


def test_a_url_counts_toward_the_header_limit(short_timeouts):
    conn = connect(short_timeouts)
    conn.sendall(b"GET /health?q=" + b"a" * (40 * 1024) + b" HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"b" * (10 * 1024)
                 + b"\r\n\r\n")
    answer, _ = read_until_closed(conn)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    conn = connect(short_timeouts)
    conn.sendall(b"GET /health?q=" + b"a" * (30 * 1024) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(conn).startswith(b"HTTP/1.1 200")
    conn.close()


COMPLETION = b'{"model": "sim:10", "prompt": "x", "max_tokens": 2}'
# What `curl --http2 http://...` sends: HTTP/1.1 asking to switch to HTTP/2 in cleartext.
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("body_framing", ["content-length", "chunked"])
def test_a_request_asking_for_an_upgrade_is_served_as_http_1_1_body_and_all(short_timeouts, body_framing):
    """httptools ends such a request at its headers, body unread, and uvicorn ran it with an empty body: `curl
    --http2` POSTing a completion got 400 "The request body is empty", and the connection served nothing more."""
    if body_framing == "chunked":
        framing, body = b"Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    else:
        framing, body = b"Content-Length: %d\r\n" % len(COMPLETION), COMPLETION
    conn = connect(short_timeouts)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + H2C + b"Content-Type: application/json\r\n"
                 + framing + b"\r\n")
    time.sleep(0.2)  # the body in a read of its own
    conn.sendall(body + HEALTH)  # and a request after it on the same connection
    (head, body), (health, _) = read_responses(conn, 2)
    conn.close()
    assert head.startswith(b"HTTP/1.1 200"), (head, body)
    assert json.loads(body)["usage"]["completion_tokens"] == 2
    assert health.startswith(b"HTTP/1.1 200")


def test_bare_line_ends_do_not_keep_an_idle_connection_open(short_timeouts):
    """The parser skips CRLFs between requests (RFC 9112 2.2), and every read stopped the keep-alive timer: two
    bytes every few seconds held a connection open for ever."""
    conn = connect(short_timeouts)
    conn.sendall(HEALTH)
    assert read_response(conn).startswith(b"HTTP/1.1 200")
    idle_from = time.monotonic()
    conn.settimeout(0.3)
    closed_at = None
    while closed_at is None and time.monotonic() - idle_from < 8:
        try:
            conn.sendall(b"\r\n")
            if conn.recv(100) == b"":
                closed_at = time.monotonic()
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic()
    conn.close()
    assert closed_at is not None, "still open 8 s after its last request, 1 s keep-alive"
    assert closed_at - idle_from < 3.5


def test_thousands_of_pipelined_upgrade_requests_are_all_answered(short_timeouts):
    """Each such request was parsed again by a nested call: some 500 of them in one read ran out of Python's stack
    (RecursionError), the rest unanswered and a traceback per read in the log."""
    count = 3000
    conn = connect(short_timeouts)
    requests = (b"GET /health HTTP/1.1\r\nHost: x\r\n" + H2C + b"\r\n") * count
    sender = threading.Thread(target=conn.sendall, args=(requests,))  # the answers are read meanwhile
    sender.start()
    answers = read_responses(conn, count)
    sender.join()
    conn.close()
    assert all(head.startswith(b"HTTP/1.1 200") for head, _ in answers)
    assert "Traceback" not in short_timeouts.log()


def test_connect_is_refused(short_timeouts):
    conn = connect(short_timeouts)
    conn.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    answer, _ = read_until_closed(conn)
    conn.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b'"invalid_http_request"' in answer


def completion(stream: bool, extra: bytes = b"") -> bytes:
    body = json.dumps({"model": "sim:10", "prompt": "hi", "max_tokens": 20, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d"
            b"\r\n\r\n" % len(body)) + body + extra


@pytest.mark.parametrize("after", [b" ", b"\x16\x03\x01\x02\x00junk\r\n\r\n"], ids=["stray byte", "TLS bytes"])
def test_bytes_the_parser_refuses_after_requests_are_answered_after_them(short_timeouts, after):
    """As nginx (RFC 9112 9.3): the requests read before them are answered, then the 400, then the connection
    closes. Before, it closed at once: the answer of the request in flight was lost, and no 400 either (a client
    whose Content-Length was one short got nothing at all)."""
    conn = connect(short_timeouts)
    conn.sendall(HEALTH + completion(stream=False) + after)  # pipelined, all in one write
    data, _ = read_until_closed(conn)
    conn.close()
    answers = re.split(rb"HTTP/1\.1 (?=\d{3} [A-Z])", data)[1:]  # (the 400's message names HTTP/1.1 too)
    assert [a[:3] for a in answers] == [b"200", b"200", b"400"], data[:2000]
    assert json.loads(answers[1].partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 20
    assert b'"invalid_http_request"' in answers[2]


def test_bytes_the_parser_refuses_during_a_stream_let_it_finish(short_timeouts):
    """Sent while a stream runs (here 20 tokens at 10 ms each), they wait for its end: every token, [DONE], the
    400, then the close."""
    conn = connect(short_timeouts)
    conn.sendall(completion(stream=True))
    data = b""
    while b"data: " not in data:  # streaming
        data += conn.recv(65536)
    conn.sendall(b"junk\r\n\r\n")
    data += read_until_closed(conn)[0]
    conn.close()
    stream, _, rest = data.partition(b"data: [DONE]")
    assert rest.lstrip(b"\r\n").startswith(b"0\r\n\r\nHTTP/1.1 400") and b'"invalid_http_request"' in rest, data[-800:]
    assert stream.count(b"data: ") >= 10


def test_a_stalled_body_gets_408_then_close(short_timeouts):
    conn = connect(short_timeouts)
    body = b'{"model": "sim:10", "prompt": "x", "max_tokens": 1}'
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body) + 100, body))  # 100 bytes never come
    stalled_at = time.monotonic()
    answer, closed_at = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 1.5 < closed_at - stalled_at < 5
    conn.close()


def test_requests_within_the_timeouts_are_unaffected(short_timeouts):
    # A keep-alive connection used every 0.5 s outlives the 1 s keep-alive timeout; a 3 s stream outlives
    # both timeouts; a body sent in pieces 1 s apart (under the 2 s between reads) is read whole.
    conn = connect(short_timeouts)
    for _ in range(4):
        conn.sendall(HEALTH)
        assert read_response(conn).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
    body = b'{"model": "sim:10", "prompt": "x", "max_tokens": 300, "ignore_eos": true, "stream": true}'
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    for piece in (body[:20], body[20:40], body[40:]):
        time.sleep(1.0)
        conn.sendall(piece)
    stream = b""
    while not stream.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        assert chunk, stream[-300:]
        stream += chunk
    assert stream.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in stream
    assert b'"finish_reason":"length"' in stream
    conn.sendall(HEALTH)
    assert read_response(conn).startswith(b"HTTP/1.1 200")
    conn.close()


def listening_sockets(process: psutil.Process) -> list:
    return [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def http_requests_counted(api: psutil.Process) -> dict[str, float]:
    """supervise_http_requests_total by status class, as a scrape of `api`'s group would give it now."""
    (path,) = {m.path for m in api.memory_maps() if os.path.basename(m.path).startswith("metrics-")}
    index = int(os.path.basename(path)[len("metrics-"):-len(".bin")])
    metrics = Metrics(os.path.dirname(path), index)  # the server's own file, only read here
    try:
        text = metrics.exposition(None, "any")
    finally:
        metrics.close()
    counts = re.findall(r'^supervise_http_requests_total\{[^}]*status="(\w+)"\} (\S+)$', text, re.M)
    return {status: float(value) for status, value in counts}


def test_sigterm_closes_the_listening_socket_and_answers_new_requests_503_while_streams_finish(start_supervise):
    server = start_supervise(*SIM)
    api = server.child_titled("ApiServer_0")
    assert listening_sockets(api)
    keep_alive = connect(server)
    keep_alive.sendall(HEALTH)
    assert read_response(keep_alive).startswith(b"HTTP/1.1 200")
    lines = []
    body = {"model": "sim:10", "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}

    def stream():
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 5
    while not lines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.signal(signal.SIGTERM)
    while listening_sockets(api):  # the drain's first act: this process closes its copy
        assert time.monotonic() < deadline + 5, server.log()[-2000:]
        time.sleep(0.02)
    keep_alive.sendall(HEALTH)
    answer, _ = read_until_closed(keep_alive)
    keep_alive.close()
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert b"connection: close" in head.lower()
    assert "shutting down" in json.loads(error)["error"]["message"]
    # Counted like every answer: what /metrics would say, read from the group's metrics files (a stopping group
    # answers no scrape), while the stream keeps the group up.
    assert http_requests_counted(api)["5xx"] == 1
    streamer.join(30)
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    assert server.wait_exit(30) == 0
