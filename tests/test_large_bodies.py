"""--max-large-request-bodies-mb: the bytes read of large bodies count while their requests run, and a body past the
limit is refused with 503 (before it is read when its Content-Length says so), so a client sending many at once
cannot take an API server out of memory (fifty 7.6 MB chats held 1.1 GB at once, eight 6 MB chats of 250,000 empty
messages 1.7 GB; nothing refused any). Bytes declared but not sent hold nothing, and small bodies never count."""
import json
import socket
import time

import grpc
import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from tests.grpc_support import GrpcSupervise, error_of
from tests.supervise_process import Supervise

MB = 2**20


@pytest.fixture(scope="module")
def server():
    with Supervise("--model", "sim:1", "--max-large-request-bodies-mb", "8") as group:
        yield group.wait_serving()


def _body(size: int) -> bytes:
    """A chat completion of about `size` bytes (its `user` field fills it: nothing to tokenize)."""
    body = {"model": "sim:1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": ""}
    body["user"] = "x" * (size - len(json.dumps(body)))
    return json.dumps(body).encode()


def _head(length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, dict, dict]:
    """Status, headers (lower-case names) and JSON body of the one answer on `sock`."""
    sock.settimeout(20)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {name.lower(): value for name, value in headers.items()}
    while len(rest) < int(headers["content-length"]):
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(rest)


def _held_open(server, size: int, sent: int) -> tuple[socket.socket, bytes]:
    """A request of `size` bytes whose head and first `sent` bytes are sent, the rest not yet: in flight, counted."""
    body = _body(size)
    sock = socket.create_connection(server.address)
    sock.sendall(_head(len(body)) + body[:sent])
    time.sleep(0.3)  # the server has read them
    return sock, body


def _served_once_free(http: httpx.Client, body: bytes) -> int:
    """`body`'s status once the server has noticed that what held the limit went (a request's end, a client gone)."""
    deadline = time.monotonic() + 10
    while True:
        status = http.post("/v1/chat/completions", content=body).status_code
        if status != 503 or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_a_large_body_past_the_limit_is_503_at_once_and_small_ones_pass(server):
    holder, held_body = _held_open(server, 7 * MB, 6 * MB)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        other = _body(3 * MB)
        refused = socket.create_connection(server.address)
        refused.sendall(_head(len(other)) + other[:64 * 1024])  # the rest never comes: answered unread
        status, headers, error = _answer(refused)
        refused.close()
        assert status == 503, error
        assert headers["retry-after"] == "1" and headers["connection"] == "close", headers
        assert error["error"]["type"] == "overloaded_error", error
        assert error["error"]["code"] == "large_request_bodies_full", error
        assert "--max-large-request-bodies-mb" in error["error"]["message"], error

        # A chunked one is refused once its bytes read say it is large.
        def chunks():
            for _ in range(3):
                yield other[:MB]
        response = http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "large_request_bodies_full"

        assert http.post("/v1/chat/completions", content=_body(512 * 1024)).status_code == 200  # small: not counted

        holder.sendall(held_body[6 * MB:])
        status, _, answer = _answer(holder)
        holder.close()
        assert status == 200, answer
        assert _served_once_free(http, other) == 200  # its request ended: nothing held
        assert http.post("/v1/chat/completions", content=_body(7 * MB)).status_code == 200  # alone, past half


def test_a_client_that_goes_mid_body_frees_what_it_held(server):
    holder, _ = _held_open(server, 7 * MB, 6 * MB)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", content=_body(3 * MB)).status_code == 503
        holder.close()
        assert _served_once_free(http, _body(3 * MB)) == 200
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_bytes_declared_but_not_sent_hold_nothing(server):
    """Four connections that declare the largest bodies and trickle them a byte at a time (the body timeout runs
    between two reads) held every large body off with 503 for as long as they went on."""
    tricklers = []
    for _ in range(4):
        sock = socket.create_connection(server.address)
        sock.sendall(_head(8 * MB) + b"{")
        tricklers.append(sock)
    try:
        time.sleep(0.3)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(2):
                assert http.post("/v1/chat/completions", content=_body(3 * MB)).status_code == 200
                for sock in tricklers:
                    sock.send(b" ")
    finally:
        for sock in tricklers:
            sock.close()


def test_a_declared_body_is_refused_when_its_bytes_read_pass_the_limit(server):
    """One that fit when it came (5 + 3 of 8 MB) but whose bytes read, beside another body's, pass the limit."""
    first, first_body = _held_open(server, 7 * MB, 5 * MB)
    second, second_body = _held_open(server, 3 * MB, 3 * MB // 2)  # 6.5 MB held
    first.sendall(first_body[5 * MB:6 * MB])  # 7.5 MB held
    time.sleep(0.3)
    second.sendall(second_body[3 * MB // 2:])
    status, _, error = _answer(second)
    second.close()
    assert status == 503 and error["error"]["code"] == "large_request_bodies_full", error
    first.sendall(first_body[6 * MB:])
    status, _, answer = _answer(first)
    first.close()
    assert status == 200, answer


def _large_call(prompt_text_bytes: int, max_tokens: int):
    """A streamed Generate whose message weighs about `prompt_text_bytes` (its `original_text`, which this server
    does not read), of a short prompt."""
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[1, 9690, 198], original_text="x" * prompt_text_bytes), stream=True,
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def test_grpc_messages_count_until_their_calls_end():
    """With --grpc the limit holds whole request messages (grpcio parses each as it arrives): a 6 MB message
    whose call runs holds 6 MB of the 8, so another gets RESOURCE_EXHAUSTED unparsed, and passes once the first
    call was cancelled; a small one passes throughout."""
    with GrpcSupervise("--model", "sim:10", "--max-large-request-bodies-mb", "8") as group:
        group.wait_serving()
        stub = group.stub()
        holder = stub.Generate(_large_call(6 * MB, max_tokens=2000))
        assert next(holder).chunk.token_ids  # running: its message is held
        error = error_of(lambda: stub.Generate(_large_call(6 * MB, max_tokens=1)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "--max-large-request-bodies-mb" in error.details() and "holds 6 MB" in error.details(), error.details()
        assert list(stub.Generate(_large_call(100_000, max_tokens=1)))[-1].complete.finish_reason == "length"
        holder.cancel()
        deadline = time.monotonic() + 10
        while True:  # the cancelled call ends on the server's loop, soon after
            try:
                answer = list(stub.Generate(_large_call(6 * MB, max_tokens=1)))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                time.sleep(0.2)
        assert answer[-1].complete.finish_reason == "length"
