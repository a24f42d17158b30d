"""Streamed events written straight to the connection (apiserver/direct_body.py, --direct-stream-events), by the
response and, while it waits, by the engine client's reader (RequestStream.handler, apiserver/streaming.py).

First the handler's contract on a RequestStream, in process. Then the real group, with the option and without it
side by side: the same text, logprobs, finishes and usage on every kind of stream (stop strings, n, several
prompts, echo); a client that stops reading mid-stream gets everything in order once it reads again while
others are served; keep-alive comments only in silence; a user middleware still sees every event.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvloop

from apiserver.request_stream import RequestStream
from tests.supervise_process import Supervise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "sim:2"


# --- the handler's contract, in process ---------------------------------------------------------------------------

def _output(index: int, finish: str | None = None):
    return SimpleNamespace(request_id="r", index=index, finish_reason=finish)


def _stream(loop, handler):
    """A stream as the engine client makes it, and its list of streams to hand over at the end of a drain."""
    to_hand: list = []
    stream = RequestStream({"r": 0}, 1, loop, to_hand)
    stream.handler = handler
    return stream, to_hand


def _drain_ends(to_hand: list) -> None:
    for stream in to_hand[:]:
        stream.hand_over()
    to_hand.clear()


def test_the_handler_gets_a_drains_outputs_together_only_while_the_consumer_waits_and_never_an_end():
    async def scenario():
        taken = []

        def handler(outputs):
            indices = [o.index for o in outputs]
            if 5 in indices:
                return False  # declined: the consumer gets them
            taken.append(indices)
            return True

        stream, to_hand = _stream(asyncio.get_running_loop(), handler)
        stream.put(_output(0))  # nobody waits yet: for the consumer
        assert [o.index for o in await stream.next_batch()] == [0] and to_hand == []
        consumer = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)  # the consumer now waits
        stream.put(_output(1))
        stream.put(_output(2))  # one drain: held together, the consumer not woken
        assert to_hand == [stream] and taken == [] and not consumer.done()
        _drain_ends(to_hand)
        assert taken == [[1, 2]] and not consumer.done()
        stream.put(_output(3))
        _drain_ends(to_hand)
        stream.put(_output(4))
        stream.put(_output(5))
        _drain_ends(to_hand)  # declined: the consumer wakes for 4 and 5
        stream.put(_output(6))  # it is woken, not waiting: for it too, behind them
        stream.put(_output(7, finish="length"))  # an end always goes to the consumer
        _drain_ends(to_hand)
        assert [o.index for o in await consumer] == [4, 5, 6, 7]
        assert taken == [[1, 2], [3]] and stream.unfinished == {"r": 0}

    uvloop.run(scenario())


def test_an_end_in_the_same_drain_takes_what_was_held_to_the_consumer_in_order():
    async def scenario():
        stream, to_hand = _stream(asyncio.get_running_loop(), lambda outputs: pytest.fail("handed an end's drain"))
        consumer = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        stream.put(_output(0))
        stream.put(_output(1, finish="stop"))
        _drain_ends(to_hand)
        assert [o.index for o in await consumer] == [0, 1]

    uvloop.run(scenario())


def test_a_failing_handler_leaves_the_outputs_to_the_consumer():
    async def scenario():
        stream, to_hand = _stream(asyncio.get_running_loop(), lambda outputs: 1 / 0)
        consumer = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        stream.put(_output(0))
        _drain_ends(to_hand)
        assert [o.index for o in await consumer] == [0]

    uvloop.run(scenario())


def test_keep_alive_silence_counts_from_the_last_outputs_the_handler_took():
    async def scenario():
        loop = asyncio.get_running_loop()
        stream, to_hand = _stream(loop, lambda outputs: True)
        started = loop.time()
        consumer = asyncio.ensure_future(stream.next_batch(0.3))
        for i in range(5):  # outputs every 0.1 s for 0.5 s: never 0.3 s of silence
            await asyncio.sleep(0.1)
            stream.put(_output(i))
            _drain_ends(to_hand)
            assert not consumer.done()
        assert await consumer == []  # 0.3 s after the last
        assert loop.time() - started >= 0.75

    uvloop.run(scenario())


# --- the real group, with and without ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def groups():
    with Supervise("--model", MODEL) as direct, Supervise("--model", MODEL, "--no-direct-stream-events") as through_send:
        yield direct, through_send


def _events(url: str, path: str, body: dict) -> list[str]:
    """The `data:` lines of one streamed answer (and any comment lines), as the client reads them."""
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line]


def _what_the_client_gets(lines: list[str]) -> dict:
    """Per choice: its text, its logprob tokens, its finish (reason, stop reason), whether the role came first;
    and the usage. Event boundaries are left out: how many tokens one event carries depends on timing."""
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    choices: dict[int, dict] = {}
    usage = None
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            seen = choices.setdefault(c["index"], {"text": "", "tokens": [], "finish": None, "role_first": None})
            assert seen["finish"] is None, "an event after the choice's finish"
            delta = c.get("delta")
            if delta is not None:  # chat
                if seen["role_first"] is None:
                    seen["role_first"] = delta.get("role") == "assistant"
                seen["text"] += delta.get("content") or ""
                if c.get("logprobs"):
                    seen["tokens"] += [(t["token"], t["logprob"], len(t["top_logprobs"])) for t in c["logprobs"]["content"]]
            else:  # completions
                seen["text"] += c["text"]
                if c.get("logprobs"):
                    seen["tokens"] += list(zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
            if c.get("finish_reason") is not None:
                seen["finish"] = (c["finish_reason"], c.get("stop_reason"))
    return {"choices": choices, "usage": usage}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the Louvre?"}]}
STREAMS = {
    "chat to max_tokens": {**CHAT, "max_tokens": 60, "ignore_eos": True, "stream_options": {"include_usage": True}},
    "chat to its end of sequence": {**CHAT, "max_tokens": 200, "stream_options": {"include_usage": True}},
    "chat, n=3 with logprobs": {**CHAT, "max_tokens": 30, "n": 3, "logprobs": True, "top_logprobs": 3,
                                "ignore_eos": True, "stream_options": {"include_usage": True}},
    "chat with a stop string": {**CHAT, "max_tokens": 100, "stop": ["Louvre"], "ignore_eos": True},
    "chat with a stop string kept": {**CHAT, "max_tokens": 100, "stop": ["café"],
                                     "include_stop_str_in_output": True, "ignore_eos": True},
    "completions, two prompts, echo with logprobs": {"model": MODEL, "prompt": ["Tell me", "about Paris"],
                                                    "max_tokens": 25, "echo": True, "logprobs": 2,
                                                    "ignore_eos": True, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_same_stream_with_and_without_direct_events(groups, name):
    body = STREAMS[name]
    path = "chat/completions" if "messages" in body else "completions"
    direct, through_send = (_what_the_client_gets(_events(g.url, path, body)) for g in groups)
    assert direct == through_send
    assert direct["choices"] and all(c["finish"] is not None and c["text"] for c in direct["choices"].values())
    if "messages" in body:
        assert all(c["role_first"] for c in direct["choices"].values())
    if "stop" in body:
        assert all(c["finish"] == ("stop", body["stop"][0]) for c in direct["choices"].values())


def test_the_whole_answer_is_what_the_stream_told(groups):
    direct, _ = groups
    body = STREAMS["chat to max_tokens"]
    whole_body = {key: value for key, value in body.items() if key != "stream_options"}  # a stream's option only
    whole = httpx.post(f"{direct.url}/v1/chat/completions", json=whole_body, timeout=60).json()
    streamed = _what_the_client_gets(_events(direct.url, "chat/completions", body))
    assert streamed["choices"][0]["text"] == whole["choices"][0]["message"]["content"]
    assert streamed["usage"] == whole["usage"]


def _chunked_body(sock: socket.socket, data: bytes = b"") -> tuple[bytes, bytes]:
    """Read one chunked HTTP response to its end, from what was read before (`data`) on: its body, de-chunked,
    and what came after it (the next response's start)."""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            more = sock.recv(1 << 20)
            assert more, "the connection closed mid-body"
            rest += more
        body, rest = body + rest[:size], rest[size + 2:]
        if size == 0:
            return body, rest


def test_a_client_that_stops_reading_gets_everything_in_order_and_others_are_served_meanwhile(groups):
    direct, _ = groups
    host, port = direct.url.removeprefix("http://").rsplit(":", 1)
    # Big events (4 choices with 20 top logprobs each: some 9 MB in all) and a small receive buffer: the
    # kernel's buffers fill, the server must wait for this client (events taken by the response's task), then
    # go on from where it was.
    body = {**CHAT, "max_tokens": 1500, "n": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "stream": True}
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    time.sleep(4)  # not reading: every step is due meanwhile
    others = [_what_the_client_gets(_events(direct.url, "chat/completions", STREAMS["chat to max_tokens"]))
              for _ in range(3)]
    assert all(o["choices"][0]["finish"] == ("length", None) for o in others)
    with sock:
        lines = [line for line in _chunked_body(sock)[0].decode().split("\n") if line]
    got = _what_the_client_gets(lines)["choices"]
    whole = httpx.post(f"{direct.url}/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    assert sorted(got) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        streamed = got[choice["index"]]
        assert streamed["text"] == choice["message"]["content"]
        assert len(streamed["tokens"]) == 1500 and all(top == 20 for _, _, top in streamed["tokens"])
        assert streamed["finish"] == ("length", None)


def test_pipelined_streams_on_one_connection_each_whole_and_in_order(groups):
    # The second request waits in uvicorn's pipeline while the first streams: its events must not go out
    # through the first's body, nor the first's after its end.
    direct, _ = groups
    host, port = direct.url.removeprefix("http://").rsplit(":", 1)
    requests = b""
    for max_tokens in (40, 7):
        data = json.dumps({**CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
        requests += (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(data), data))
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(requests)
        first, after = _chunked_body(sock)
        answers = [first, _chunked_body(sock, after)[0]]
    for max_tokens, answer in zip((40, 7), answers):
        lines = [line for line in answer.decode().split("\n") if line]
        got = _what_the_client_gets(lines)["choices"][0]
        whole = httpx.post(f"{direct.url}/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens,
                                                                      "ignore_eos": True}, timeout=30).json()
        assert got["text"] == whole["choices"][0]["message"]["content"] and got["finish"] == ("length", None)


def test_no_keep_alive_comment_while_events_flow_only_in_silence():
    with Supervise("--model", "sim:20", "--sse-keep-alive-interval", "0.5") as paced, \
            Supervise("--model", "sim:800", "--sse-keep-alive-interval", "0.1") as slow:
        flowing = _events(paced.url, "chat/completions", {**CHAT, "model": "sim:20", "max_tokens": 100,
                                                          "ignore_eos": True})
        assert not [line for line in flowing if line.startswith(":")]  # 2 s of events, one every 20 ms
        silent = _events(slow.url, "chat/completions", {**CHAT, "model": "sim:800", "max_tokens": 3,
                                                        "ignore_eos": True})
        assert [line for line in silent if line == ": keep-alive"]  # 800 ms between events


class AnnotateMiddleware:
    """A user middleware that changes bodies: each streamed body message gets a comment line before it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def annotated(message):
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": b": via middleware\n\n" + message["body"]}
            await send(message)

        await self.app(scope, receive, annotated)


def test_a_user_middleware_sees_every_event():
    with Supervise("--model", "sim:5", "--middleware", "tests.test_direct_stream_events:AnnotateMiddleware",
                   env={"PYTHONPATH": REPO}) as group:
        lines = _events(group.url, "chat/completions", {**CHAT, "model": "sim:5", "max_tokens": 40,
                                                        "ignore_eos": True})
    data = [i for i, line in enumerate(lines) if line.startswith("data: {")]
    assert len(data) > 10 and lines[-1] == "data: [DONE]"
    # Each body message is one event, the last one's chunk and [DONE] together: a comment before each.
    assert all(lines[i - 1] == ": via middleware" for i in data)


def test_direct_stream_events_is_refused_with_grpc():
    import subprocess

    from tests.supervise_process import SUPERVISE

    result = subprocess.run([SUPERVISE, "--grpc", "--no-direct-stream-events", "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--direct-stream-events applies to the HTTP API" in result.stderr


def test_many_streams_at_once_each_whole(groups):
    direct, _ = groups
    body = STREAMS["chat to max_tokens"]
    expected = _what_the_client_gets(_events(direct.url, "chat/completions", body))
    results: list = []

    def one():
        results.append(_what_the_client_gets(_events(direct.url, "chat/completions", body)))

    threads = [threading.Thread(target=one) for _ in range(48)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert len(results) == 48 and all(r == expected for r in results)
