"""--max-stream-backlog-mb: a client that stops reading a stream cannot make its API server hold the engine's output
without end. The engine writes on; the response waits for the client (a paused transport, gRPC's flow control); past
the limit the request is aborted in the engine, what waited is dropped, and the stream ends with an error event
(gRPC: RESOURCE_EXHAUSTED) once the client reads again. A client that keeps up is not touched."""
import json
import socket
import time

import grpc
import httpx
import pytest

from tests.grpc_support import GrpcSupervise, generate_request
from tests.supervise_process import Supervise, title_of

MODEL = "sim:2"  # 500 steps a second: n=8 with 20 top logprobs makes some 10 MB of output a second
LIMIT_MB = 4
BIG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 8000,
       "ignore_eos": True, "n": 8, "logprobs": True, "top_logprobs": 20, "stream": True}


@pytest.fixture(scope="module")
def http_group():
    with Supervise("--model", MODEL, "--max-stream-backlog-mb", str(LIMIT_MB)) as server:
        yield server


def _api_server(group):
    (api,) = [c for c in group.children() if "ApiServer_" in title_of(c)]
    return api


def _running(group) -> int:
    (engine,) = httpx.get(group.url + "/load", timeout=10).json()["engines"]
    return engine["num_running"]


def _wait_idle(group, timeout: float) -> float:
    """Seconds until the engine runs nothing (the request aborted)."""
    started = time.monotonic()
    while _running(group):
        assert time.monotonic() - started < timeout, "the engine still generates for a client that does not read"
        time.sleep(0.2)
    return time.monotonic() - started


def _unread_stream(group) -> socket.socket:
    """A streamed BIG request on a connection whose client reads nothing (a small receive buffer, soon full)."""
    host, port = group.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    data = json.dumps(BIG).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _stream_error(sock: socket.socket) -> dict:
    """Read the stream to its end: its error event's error."""
    received = b""
    with sock:
        while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
            more = sock.recv(1 << 20)
            assert more, "the server closed before the stream's end"
            received += more
    events = [line for line in received.decode(errors="replace").split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return json.loads(events[-2].removeprefix("data: "))["error"]


def test_a_client_that_stops_reading_is_cut_off_with_an_error_event(http_group):
    api = _api_server(http_group)
    rss_before = api.memory_info().rss
    sock = _unread_stream(http_group)
    time.sleep(0.5)  # generating, and the kernel's buffers full: the response waits for this client
    _wait_idle(http_group, timeout=30)
    assert api.memory_info().rss - rss_before < 20 * LIMIT_MB * 2**20  # the backlog went, not the server's memory
    assert "its client reads slower than the engine writes" in http_group.log()
    error = _stream_error(sock)
    assert error["code"] == "stream_backlog_full" and "too slowly" in error["message"]
    assert httpx.get(http_group.url + "/health", timeout=10).status_code == 200


def test_clients_that_stop_reading_are_cut_off_when_their_backlogs_add_up():
    """Each stream under --max-stream-backlog-mb, many such add up without a bound (256 streams of 64 MB: 16 GB):
    past --max-total-stream-backlog-mb the streams that hold most are ended, and one that reads is not touched."""
    total_mb = 3
    with Supervise("--model", MODEL, "--max-total-stream-backlog-mb", str(total_mb)) as group:
        api = _api_server(group)
        rss_before = api.memory_info().rss
        unread = [_unread_stream(group) for _ in range(3)]
        body = {**BIG, "max_tokens": 300, "n": 2, "top_logprobs": 5}
        with httpx.stream("POST", group.base_url + "/chat/completions", json=body, timeout=60) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
        _wait_idle(group, timeout=30)
        assert api.memory_info().rss - rss_before < 20 * total_mb * 2**20
        for sock in unread:
            error = _stream_error(sock)
            assert error["code"] == "stream_backlog_full", error
            assert f"this server's streams together at most {total_mb} MB" in error["message"], error
        assert group.log().count(f"(--max-total-stream-backlog-mb {total_mb})") == 3


def test_a_client_that_keeps_up_gets_the_whole_stream(http_group):
    body = {**BIG, "max_tokens": 300, "n": 2, "top_logprobs": 5}
    with httpx.stream("POST", http_group.base_url + "/chat/completions", json=body, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert not any('"error"' in event for event in events)
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
    assert finishes == ["length", "length"]


def test_a_grpc_client_that_stops_reading_gets_resource_exhausted():
    with GrpcSupervise("--model", MODEL, "--max-stream-backlog-mb", str(LIMIT_MB)) as group:
        channel = grpc.insecure_channel(group.target, options=[("grpc.http2.lookahead_bytes", 0)])
        call = group.stub().__class__(channel).Generate(generate_request(
            list(range(1, 200)), stream=True, max_tokens=7000, ignore_eos=True, n=8, logprobs=20))
        next(call)  # then nothing read: flow control holds the server's writes back
        deadline = time.monotonic() + 30
        while "its client reads slower than the engine writes" not in group.log():
            assert time.monotonic() < deadline, "the server still holds the output of a client that does not read"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too slowly" in ended.value.details()
        channel.close()
