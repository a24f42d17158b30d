"""--access-log: one line per HTTP request, as an operator reads it in the journal: who asked, the request line,
the status, how long the answer took (a stream's at its end). Probes left out where asked; a hostile path cannot
write a line of its own."""
import re
import socket
import time

import httpx
import pytest

from tests.supervise_process import Supervise, wait_for

SIM = "sim:10"  # one token every 10 ms: a stream of 40 takes some 0.4 s
LINE = re.compile(r'apiserver\.access: 127\.0\.0\.1:(\d+) - "(\S+) (\S+) HTTP/1\.1" (\S+) (\d+\.\d{3}) s$')


@pytest.fixture(scope="module")
def server():
    with Supervise("--model", SIM, "--api-server-count", "2", "--access-log",
                   "--disable-access-log-for-endpoints", "/health,/metrics/") as group:  # (its slash ignored)
        yield group


def access_lines(server: Supervise) -> list[tuple[str, str, str, float]]:
    """(method, target, status, seconds) of every access line so far."""
    found = []
    for line in server.log().splitlines():
        match = LINE.search(line)
        if match:
            found.append((match[2], match[3], match[4], float(match[5])))
        else:
            assert "apiserver.access" not in line, line  # every access line has the one format
    return found


def test_each_request_is_one_line_and_a_stream_s_comes_at_its_end(server):
    before = len(access_lines(server))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200  # excluded
        assert client.get("/metrics").status_code == 200  # excluded
        assert client.get("/v1/models").status_code == 200
        started = time.monotonic()
        with client.stream("POST", "/v1/completions", json={"model": SIM, "prompt": "hi", "max_tokens": 40,
                                                              "ignore_eos": True, "stream": True}) as stream:
            assert stream.status_code == 200
            _ = b"".join(stream.iter_bytes())
        took = time.monotonic() - started
        assert client.post("/v1/completions", json={"model": SIM, "prompt": "hi", "max_tokens": -1}).status_code == 400
    wait_for(lambda: len(access_lines(server)) >= before + 3, 10, "three access lines", server)
    lines = access_lines(server)[before:]
    assert [line[:3] for line in lines] == [("GET", "/v1/models", "200"), ("POST", "/v1/completions", "200"),
                                            ("POST", "/v1/completions", "400")], lines
    assert 0.3 <= lines[1][3] <= took + 0.05, (lines[1], took)  # the whole stream, written once it ended


def test_every_request_of_a_burst_has_its_line(server):
    """The access log went through the log's flood limit (20 lines, then 1 a second from one place in the code):
    at 8 streaming clients 238 requests left 34 lines, and a client could hide a request behind 20 cheap ones."""
    before = len(access_lines(server))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i in range(60):
            assert client.get(f"/v1/models?burst={i}").status_code == 200
    wait_for(lambda: len(access_lines(server)) >= before + 60, 10, "60 access lines", server)
    targets = [line[1] for line in access_lines(server)[before:]]
    assert sorted(targets) == sorted(f"/v1/models?burst={i}" for i in range(60)), targets
    assert "not logged" not in server.log()


def test_a_hostile_path_cannot_write_a_line_of_its_own(server):
    """A `%0a` in the path would be a line break once decoded: the line keeps the path as sent."""
    before = len(access_lines(server))
    forged = "/v1/x%0a20:00:00%20INFO%20%5BApiServer_0%5D%20apiserver.access:%20forged"
    assert httpx.get(f"{server.url}{forged}?q=%0d%0a", timeout=10).status_code == 404
    wait_for(lambda: len(access_lines(server)) > before, 10, "the access line", server)
    assert access_lines(server)[before][:3] == ("GET", f"{forged}?q=%0d%0a", "404")
    assert "] apiserver.access: forged" not in server.log()
    # A raw `"` (which clients may send in a query) cannot end the quoted request line early.
    with socket.create_connection(server.address) as raw:
        raw.sendall(b'GET /v1/models?q="x" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
        while raw.recv(65536):
            pass
    wait_for(lambda: len(access_lines(server)) > before + 1, 10, "the access line", server)
    assert access_lines(server)[before + 1][:3] == ("GET", "/v1/models?q=%22x%22", "200")


def test_a_client_that_leaves_before_its_answer_is_logged_when_the_request_ends(server):
    before = len(access_lines(server))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(10, read=0.3),
                   json={"model": SIM, "prompt": "hi", "max_tokens": 500, "ignore_eos": True})
    wait_for(lambda: len(access_lines(server)) > before, 10, "the access line", server)
    method, target, status, seconds = access_lines(server)[before]
    # nginx's 499 (client closed request), as /metrics counts it, and once the request stopped: not after the
    # 5 s its 500 tokens would have taken
    assert (method, target, status) == ("POST", "/v1/completions", "499") and seconds < 3, access_lines(server)[before]
