"""Lists a client can make long, `stop` strings and `stop_token_ids`, cost their own request, not everyone else's.

Before: 10,000 stop strings on 16 choices (150 KB) held an API server's event loop past the heartbeat timeout, and
the supervisor killed it with every stream on it; a million stop token ids on 128 choices (7 MB) made every step
of the engine take 2.4 s, for every client of that engine."""
import threading
import time

import httpx
import pytest

from tests.load import slowest_health_beside
from tests.supervise_process import Supervise

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    # Without the limit on large bodies held at once (tests/test_large_bodies.py): here, what the server does with
    # as many as get past it.
    with Supervise("--model", "sim:5", "--api-server-count", "1", "--max-large-request-bodies-mb", "0") as group:
        yield group.wait_serving()


def _body(**extra) -> dict:
    return {"model": "sim:5", "messages": [{"role": "user", "content": "hi"}], **extra}


def _timed_beside(server, hostile: dict) -> tuple[httpx.Response, float]:
    """The hostile request's response, and how long a plain 40-token request took while it ran."""
    answer: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answer.append(http.post(CHAT, json=hostile))

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # it runs
    with httpx.Client(base_url=server.url, timeout=120) as http:
        started = time.monotonic()
        plain = http.post(CHAT, json=_body(max_tokens=40, ignore_eos=True))
        took = time.monotonic() - started
    sender.join()
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 40
    return answer[0], took


def test_a_vocabulary_of_stop_token_ids_slows_no_other_request(server):
    ids = [49000 + i % 100 for i in range(300_000)]  # ids the simulated model never draws, each 3,000 times
    hostile = _body(n=64, max_tokens=80, ignore_eos=True, stop_token_ids=ids)
    response, took = _timed_beside(server, hostile)
    assert response.status_code == 200, response.text
    assert all(c["finish_reason"] == "length" for c in response.json()["choices"])
    assert took < 2.0, f"a 40-token request took {took:.1f} s beside it (0.2 s at 5 ms a step)"


def test_stop_strings_past_the_limit_are_a_400_and_the_limit_costs_no_one(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post(CHAT, json=_body(max_tokens=4, stop=[f"zq{i:05d}x" for i in range(65)]))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "stop" and "--max-stop-strings" in error["message"], error
    # 64 (and a thousand copies of one, counted once) on 16 choices: served, and the server keeps its pace.
    stops = [f"zq{i:05d}x" for i in range(63)] + ["never"] * 1000
    response, took = _timed_beside(server, _body(n=16, max_tokens=120, ignore_eos=True, stop=stops))
    assert response.status_code == 200, response.text
    assert took < 2.0, f"a 40-token request took {took:.1f} s beside it"


def test_stop_strings_past_the_character_limit_are_a_400(server):
    """Looking for a stop string in a token's text costs about its length: 64 of 20,000 characters on 16 choices of
    8,000 tokens took 23 s of an API server's CPU (1.6 s without). Past --max-stop-string-chars (8,192 in all,
    counted once each) a 400; at it, served."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        long = [f"{i:02d}" + "~" * 126 for i in range(64)]  # 8,192 characters
        response = http.post(CHAT, json=_body(max_tokens=4, stop=long[:-1] + [long[-1] + "~"]))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "stop" and "--max-stop-string-chars" in error["message"], error
        assert "8,193 characters" in error["message"], error
        served = http.post(CHAT, json=_body(max_tokens=4, stop=long + long))
        assert served.status_code == 200, served.text


def test_a_whole_answer_of_many_logprobs_does_not_hold_the_event_loop(server):
    """840,000 logprob entries (under --max-logprob-entries' million), formatted and encoded: 4 s of the event loop
    before, when every other client of the server waited; in a worker thread now."""
    body = _body(n=100, max_tokens=400, ignore_eos=True, logprobs=True, top_logprobs=20)
    answer: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            answer.append(http.post(CHAT, json=body))

    slowest = slowest_health_beside(server.url, send)
    assert answer[0].status_code == 200
    choices = answer[0].json()["choices"]
    assert len(choices) == 100 and all(len(c["logprobs"]["content"]) == 400 for c in choices)
    assert slowest < 2.0, f"/health waited {slowest:.1f} s"


def test_an_echo_repeated_past_the_limit_is_a_400_before_it_runs(server):
    """`echo` sends each choice's prompt back: 256 prompts of 5,200 tokens (an 8 MB body) with n=128 made a 1 GB
    response, which held the event loop 3.4 s and grew the API server 1 GB. Past --max-echo-tokens (4,194,304)
    it is refused before it runs; under it, served."""
    prompts = ["hello world " * 1100] * 16  # 2,201 tokens each
    body = {"model": "sim:5", "prompt": prompts, "max_tokens": 1, "echo": True}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        refused = http.post("/v1/completions", json={**body, "n": 128})  # 4.5 million tokens echoed
        assert refused.status_code == 400, refused.status_code
        error = refused.json()["error"]
        assert error["param"] == "echo" and "--max-echo-tokens" in error["message"], error
        served = http.post("/v1/completions", json={**body, "n": 2})
        assert served.status_code == 200, served.text
        choices = served.json()["choices"]
        assert len(choices) == 32 and all(c["text"].startswith(prompts[0]) for c in choices)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def test_tokenizing_megabytes_of_text_costs_its_ids_not_a_gigabyte(server):
    """The Rust tokenizer holds ~450 bytes per token of a text while it encodes it: an 8 MB /tokenize took an API
    server from 120 MB to 910 MB (three at once 1.8 GB), and its allocator kept most of it. Long text is encoded
    in pieces now (apiserver.long_text), the same ids."""
    api_server = server.child_titled("ApiServer_0").pid
    with open(f"/proc/{api_server}/clear_refs", "w") as clear:
        clear.write("5")  # the peak RSS starts again from the RSS now
    before = _peak_rss_mb(api_server)
    prompt = "hello world, " * 300_000  # 3.9 MB, 900,000 tokens
    with httpx.Client(base_url=server.url, timeout=120) as http:
        response = http.post("/tokenize", json={"model": "sim:5", "prompt": prompt})
    assert response.status_code == 200 and response.json()["count"] == 900_001
    grown = _peak_rss_mb(api_server) - before
    assert grown < 200, f"the API server grew {grown:.0f} MB at its peak"


def test_large_bodies_arriving_together_are_parsed_one_loop_pass_at_a_time(server):
    """A prompt of 4 million token ids (an 8 MB body) took 1.5 s of the event loop to parse, most of it failing as
    a list of strings first, and eight sent together were parsed in one pass of the loop: 10.7 s without a
    heartbeat, and the supervisor killed the API server. Now the prompt's form is read from its first item
    (0.4 s), and large bodies are parsed one per pass, so /health and the heartbeat get their turn between."""
    body = ('{"model": "sim:5", "max_tokens": 1, "prompt": [' + ",".join(["1"] * 4_000_000) + "]}").encode()
    answers: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answers.append(http.post("/v1/completions", content=body,
                                     headers={"content-type": "application/json"}).status_code)

    senders = [threading.Thread(target=send) for _ in range(6)]
    for sender in senders:
        sender.start()
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=60) as http:
        while any(sender.is_alive() for sender in senders):
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
    assert answers == [400] * 6  # past the context, after parsing
    assert slowest < 2.0, f"/health waited {slowest:.1f} s"
    assert "killing" not in server.log()


def test_detokenizing_millions_of_ids_does_not_hold_the_event_loop(server):
    """4 million ids (an 8 MB body) were decoded in the event loop, and tokenizers' decode keeps the GIL: /health
    waited 1.3-1.9 s. Many ids are decoded in the worker thread now, by decode_batch, which lets go of it."""
    body = ('{"model": "sim:5", "tokens": [' + ",".join(["1"] * 4_000_000) + "]}").encode()  # <|im_start|>
    answer: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answer.append(http.post("/detokenize", content=body, headers={"content-type": "application/json"}))

    slowest = slowest_health_beside(server.url, send)
    assert answer[0].status_code == 200 and len(answer[0].content) == len('{"prompt":""}') + 12 * 4_000_000
    assert slowest < 1.0, f"/health waited {slowest:.1f} s"


def test_tokenizing_a_chat_of_many_messages_costs_its_ids_not_a_gigabyte(server):
    """A chat's text has no spaces to cut at when its messages are short, but the tokenizer splits at added tokens
    (<|im_start|>) itself: the pieces between them are encoded apart too. 250,000 one-letter messages took an API
    server from 74 MB to 1 GB, 456 MB now (the rest its Python objects)."""
    api_server = server.child_titled("ApiServer_0").pid
    with open(f"/proc/{api_server}/clear_refs", "w") as clear:
        clear.write("5")
    before = _peak_rss_mb(api_server)
    body = ('{"model": "sim:5", "messages": [' + ",".join(['{"role":"user","content":"a"}'] * 120_000) + "]}").encode()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        response = http.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["count"] > 600_000
    grown = _peak_rss_mb(api_server) - before
    assert grown < 300, f"the API server grew {grown:.0f} MB at its peak"


def test_a_chat_of_many_empty_messages_holds_the_event_loop_no_longer_than_its_parse(server):
    """250,000 empty messages (a 7.9 MB body) are cheap to parse next to what followed inline, since their text
    was empty: a validator per message in the parse, then the dicts, the chat template's loop and 1.4 million ids of
    role markers held the loop 4 s (the parse alone 1.3 s). Now many messages go to the worker thread whatever
    their length. The parse itself cannot be split: measured here as the same body for an unknown model (404 right
    after it), the bound the whole request's hold is held to."""
    messages = ",".join(['{"role":"user","content":""}', '{"role":"assistant","content":""}'] * 125_000)

    def slowest_beside(model: str, status: int) -> float:
        body = ('{"model": "%s", "max_tokens": 1, "messages": [%s]}' % (model, messages)).encode()
        answer: list[int] = []

        def send() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                answer.append(http.post(CHAT, content=body, headers={"content-type": "application/json"}).status_code)

        slowest = slowest_health_beside(server.url, send)
        assert answer == [status]
        return slowest

    parse = slowest_beside("no-such-model", 404)
    whole = slowest_beside("sim:5", 400)  # 1.4 million prompt tokens: past the context, once they are counted
    assert whole < parse + 0.7, f"/health waited {whole:.1f} s beside the chat, {parse:.1f} s beside its parse"
