"""What a client sends cannot grow the group's memory or its log without bound: caches keyed by a request's content
keep digests and stay within their bounds, and a flood of bad requests leaves a bounded number of log lines.
Each test measures what an operator would watch: a process's RSS, the log's lines."""
import itertools
import random
import socket
import time

import httpx
import pytest

from tests.supervise_process import Supervise

MB = 2**20
_unique = itertools.count()


@pytest.fixture(scope="module")
def sim_group():
    with Supervise("--model", "sim:1") as server:
        yield server


def _comment_grammar(size: int) -> str:
    """A valid Lark grammar of `size` bytes or so, unique each call, that the API servers' check passes in tens of
    milliseconds: one short sentence, and a long comment."""
    return f'start: "a"\n// {next(_unique)} ' + "x" * size + "\n"


def _constrained_chat(url: str, model: str, grammar: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Say a."}], "max_tokens": 4,
            "structured_outputs": {"grammar": grammar}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _rss_growth(process, send, warm_up: int, measured: int) -> int:
    """How many bytes `process` grew over `measured` calls of send(), after `warm_up` of them."""
    for _ in range(warm_up):
        send()
    before = process.memory_info().rss
    for _ in range(measured):
        send()
    return process.memory_info().rss - before


def test_unique_large_grammars_do_not_grow_the_api_server(sim_group):
    # The check's verdicts used to be kept by the grammar's text: 256 of them, megabytes each.
    api = sim_group.child_titled("ApiServer_0")
    grown = _rss_growth(api, lambda: _constrained_chat(sim_group.url, "sim:1", _comment_grammar(2 * MB)),
                        warm_up=3, measured=30)
    assert grown < 24 * MB, f"the API server grew {grown / MB:.0f} MB over 30 grammars of 2 MB"


def test_unique_large_grammars_do_not_grow_the_engine(served):
    # The engine kept 512 compiled grammars by their text: with the cache's text bound lifted, 40 grammars of 1 MB
    # grew it 121 MB. Bounded, it moves by the allocator's noise, which depends on what the shared group served
    # before (41 MB over 20 grammars once in a full suite, 6-19 MB alone).
    engine = served.child_titled("EngineCore_DP0")
    grown = _rss_growth(engine, lambda: _constrained_chat(served.url, "SmolLM2-135M-Instruct", _comment_grammar(MB)),
                        warm_up=17, measured=40)
    assert grown < 60 * MB, f"the engine grew {grown / MB:.0f} MB over 40 grammars of 1 MB"


def test_unique_long_prompts_do_not_grow_the_api_server(sim_group):
    # The renderer's cache of the text between special tokens kept 512 pieces of up to 8,192 characters, whatever
    # their ids weighed: an emoji is three token ids here. Two such messages are too long a prompt (a 400), but
    # only once they are tokenized, inline (under 16K characters) and through that cache.
    api = sim_group.child_titled("ApiServer_0")
    rng = random.Random(0)
    emoji = [chr(c) for c in range(0x1F300, 0x1F5FF)]

    def send() -> None:
        messages = [{"role": role, "content": f"{next(_unique)} " + "".join(rng.choice(emoji) for _ in range(8000))}
                    for role in ("user", "assistant")]
        r = httpx.post(f"{sim_group.url}/v1/chat/completions", json={"model": "sim:1", "messages": messages}, timeout=60)
        assert r.status_code == 400 and "context_length_exceeded" in r.text, r.text

    grown = _rss_growth(api, send, warm_up=18, measured=32)
    assert grown < 6 * MB, f"the API server grew {grown / MB:.0f} MB over 64 messages of 8,000 emoji"


def _send_garbage(address: tuple[str, int]) -> None:
    """A connection that sends what is not HTTP: uvicorn logs a warning for each, and answers 400."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")


def test_a_flood_of_bad_requests_leaves_a_bounded_number_of_log_lines(sim_group):
    started = time.monotonic()
    for _ in range(150):
        _send_garbage(sim_group.address)
    seconds = time.monotonic() - started
    time.sleep(1.5)  # one more line may pass now, saying how many were dropped
    _send_garbage(sim_group.address)
    lines = [line for line in sim_group.log().splitlines() if "Invalid HTTP request received" in line]
    assert len(lines) <= 20 + seconds + 3, f"{len(lines)} lines for 151 bad requests in {seconds:.1f} s"
    assert "more from here not logged" in lines[-1]
