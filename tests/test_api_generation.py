"""The generation endpoints' request fields, through the official openai client against a real `supervise`
group running the simulated engine (enginecore/simulated.py), whose output is known in advance: it repeats
SENTENCE, then EOS. That makes every text, token count and finish reason exact."""
import httpx
import openai
import pytest

from enginecore.simulated import SENTENCE
from tests.supervise_process import Supervise

MODEL = "sim:2"
HELLO = [{"role": "user", "content": "hello"}]
SENTENCE_TOKENS = 38  # SENTENCE's token count with the embedded tokenizer; EOS makes 39


@pytest.fixture(scope="module")
def sim():
    with Supervise("--model", MODEL, "--api-server-count", "2") as server:
        yield server


@pytest.fixture(scope="module")
def client(sim):
    return openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=30)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_chat_whole_answer(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO)
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == SENTENCE  # multi-byte characters («», é, —, 🥐) intact
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == SENTENCE_TOKENS + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_whole_answer(client):
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == "Paris"  # the role comes with the first token, as in vLLM
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SENTENCE
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done(sim):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{sim.base_url}/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_max_tokens_and_max_completion_tokens(client):
    for field in ("max_tokens", "max_completion_tokens"):
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, **{field: 5})
        assert reply.choices[0].message.content == "Paris is the capital of"
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 5


def test_n_choices_and_usage(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 12  # every choice's tokens, the prompt once
    single = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens


def test_stop_string_split_across_tokens_never_leaks(client):
    # " Eiffel" is two tokens (" E", "iffel"): the text before it is held back until the match is clear.
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, stop=[" Eiffel", "zzz"])
    assert whole.choices[0].message.content == "Paris is the capital of France. It is known for the"
    assert whole.choices[0].finish_reason == "stop"
    text, finish = streamed_text(client.chat.completions.create(model=MODEL, messages=HELLO, stop=" Eiffel", stream=True))
    assert text == whole.choices[0].message.content
    assert finish == "stop"


def test_include_stop_str_in_output(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, stop=["France"], extra_body={"include_stop_str_in_output": True}
    )
    assert reply.choices[0].message.content == "Paris is the capital of France"


def test_engine_extras(client):
    eos_ignored = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=50, extra_body={"ignore_eos": True})
    assert eos_ignored.usage.completion_tokens == 50 and eos_ignored.choices[0].finish_reason == "length"
    at_least = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=45, extra_body={"min_tokens": 45})
    assert at_least.usage.completion_tokens == 45
    france = 4649  # " France"
    stopped = client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"stop_token_ids": [france]})
    assert stopped.choices[0].message.content == "Paris is the capital of"  # the stop token unshown, as in vLLM
    assert stopped.choices[0].finish_reason == "stop"
    extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "priority": 3, "seed": 7}
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body=extras).choices


def test_chat_message_forms(client):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Capital?", "name": "ann"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, user="u-1", response_format={"type": "text"}
    )
    assert reply.choices[0].message.content == "Paris is"


def test_continue_final_message(sim):
    fields = {
        "model": MODEL, "add_generation_prompt": False, "continue_final_message": True,
        "messages": [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "The answer:"}],
    }
    tokens = httpx.post(f"{sim.url}/tokenize", json=fields, timeout=30).json()["tokens"]
    reply = httpx.post(f"{sim.base_url}/chat/completions", json={**fields, "max_tokens": 1}, timeout=30).json()
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    assert tokens[-1] != 2  # the assistant message stays open: no <|im_end|> after it


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == ["Paris", " is", " the"]
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, stream=True)
    tokens = [c.token for chunk in stream if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert tokens == ["Paris", " is", " the"]


def test_completion_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["Paris", " is", " the"]
    assert logprobs.text_offset == [0, 5, 8]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_completion_forms(client):
    echoed = client.completions.create(model=MODEL, prompt="Q: ", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "Q: Paris is"
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=1)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 4
    token_prompt = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert token_prompt.usage.prompt_tokens == 3 and token_prompt.choices[0].text == "Paris is"
    stop = client.completions.create(model=MODEL, prompt="x", stop="capital")
    assert stop.choices[0].text == "Paris is the " and stop.choices[0].finish_reason == "stop"


def test_completion_stream_with_usage(client):
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Paris is the capital"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_request_id_header_and_body(sim):
    url = f"{sim.base_url}/chat/completions"
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1, "request_id": "from-body"}
    assert httpx.post(url, json=body, timeout=30).json()["id"] == "chatcmpl-from-body"
    headers = {"X-Request-Id": "from-header", "X-Priority": "2"}
    assert httpx.post(url, json=body, headers=headers, timeout=30).json()["id"] == "chatcmpl-from-header"
    completion = httpx.post(f"{sim.base_url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                            headers={"X-Request-Id": "c1"}, timeout=30)
    assert completion.json()["id"] == "cmpl-c1"


def test_same_request_id_twice_at_once(client):
    # Clients reuse ids; the engine must still see two distinct requests.
    import concurrent.futures

    def ask():
        return client.chat.completions.create(model=MODEL, messages=HELLO, extra_headers={"X-Request-Id": "dup"})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: ask(), range(4)))
    assert all(r.choices[0].message.content == SENTENCE for r in replies)


def test_concurrent_streams_all_complete(client):
    import concurrent.futures

    def one(_):
        return streamed_text(client.chat.completions.create(model=MODEL, messages=HELLO, stream=True))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    assert all(r == (SENTENCE, "stop") for r in results)


def test_chat_stream_sends_each_role_with_its_first_token(client):
    """No event before the first generated token: a client timing the first chunk times the first token."""
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=3, stream=True))
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index not in firsts:
                firsts[choice.index] = choice.delta
            else:
                assert choice.delta.role is None  # once per choice
    assert sorted(firsts) == [0, 1]
    # The first token is "Paris"; a loaded machine may hand out the next with it in the same event.
    assert all(d.role == "assistant" and d.content.startswith("Paris") for d in firsts.values())
