"""Issue 4's surface against the real engine and the embedded model (the session's shared group): the
fields whose meaning depends on real sampling, checked where the simulated engine cannot tell."""
import math

import httpx
import openai
import pytest

from tests.float_noise import floats_loosened

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Against float32 transformers: the served default multiplies in bfloat16 on CPUs that have it (README, CPU:
# 0.005 nats/token on average, single tokens up to ~0.1; tests/test_quantization.py bounds it); a misaligned
# prompt position would be off by whole nats.
LOGPROB_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_invocations_answers_paris(served, model):
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 20}
    reply = httpx.post(f"{served.url}/invocations", json=body, timeout=120).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_stop_string_cuts_before_paris(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=20, stop=["Paris"])
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_an_answer_only_after_min_tokens(client, model, stream):
    """vLLM's rule: stop strings are looked for from the token after the min_tokens-th on, as EOS and stop token
    ids are. `stop: [" "]` with `min_tokens: 8` ended the answer at its first token."""
    args = dict(model=model, prompt="The quick brown fox jumps over the lazy dog and", temperature=0, max_tokens=16,
                stop=[" "], extra_body={"min_tokens": 8})
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        used = chunks[-1].usage.completion_tokens
    else:
        reply = client.completions.create(**args)
        text, finish, used = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage.completion_tokens
    assert used >= 8 and finish == "stop" and text.count(" ") >= 3, (text, finish, used)
    assert not text.endswith(" ")  # the stop string that did end it is not shown


ANSWER = [{"role": "user", "content": "What is the capital of France? One short sentence."}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_that_ends_an_answer_is_counted_not_shown(served, client, model, stream):
    """As in vLLM: the EOS or stop_token_ids token that ended a choice is not in its text unless
    include_stop_str_in_output; with skip_special_tokens false every answer had ended in `<|im_end|>`."""
    def answer(**extra):
        request = dict(model=model, messages=ANSWER, temperature=0, max_tokens=40, extra_body=extra)
        if not stream:
            reply = client.chat.completions.create(**request)
            return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens

    text, finish, tokens = answer()
    assert finish == "stop" and text.endswith(".") and "<|im_end|>" not in text
    assert answer(skip_special_tokens=False) == (text, finish, tokens)
    assert answer(skip_special_tokens=False, include_stop_str_in_output=True) == (text + "<|im_end|>", finish, tokens)
    period = httpx.post(f"{served.url}/tokenize", json={"model": model, "prompt": "."}).json()["tokens"]
    cut, finish, cut_tokens = answer(stop_token_ids=period)
    assert (cut, finish, cut_tokens) == (text[:-1], "stop", tokens - 1)  # the period counted, EOS never sampled


def test_logprobs_are_real_log_probabilities(client, model):
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    for entry in reply.choices[0].logprobs.content:
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the sampled token is the likeliest


def test_n_samples_with_usage(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=1.0, max_tokens=6, n=2, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    assert 2 <= reply.usage.completion_tokens <= 12  # both choices' tokens
    single = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=1)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once


FRANCE = "The capital of France is"


def _prompt_ids(served, text: str) -> list[int]:
    return httpx.post(f"{served.url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


def _reference_logprobs(prompt: list[int]) -> list[float]:
    """Plain transformers: each prompt token's log_softmax from one forward pass (the engine test's reference)."""
    from tests.test_engine_prompt_logprobs import _reference

    raw = _reference(tuple(prompt))
    return [raw[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]


def test_echo_with_logprobs_covers_the_prompt(served, client, model):
    prompt = _prompt_ids(served, FRANCE)
    reply = client.completions.create(model=model, prompt=FRANCE, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(FRANCE) and len(choice.text) > len(FRANCE)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt) + 1
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs[1:])
    for i, top in enumerate(lp.top_logprobs[1:], start=1):  # the two likeliest, and the echoed token itself
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and len(top) in (2, 3)
    assert lp.token_logprobs[1:-1] == pytest.approx(_reference_logprobs(prompt), abs=LOGPROB_TOLERANCE)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 1


def test_echo_with_max_tokens_zero_returns_just_the_prompt(served, client, model):
    prompt = _prompt_ids(served, FRANCE)
    reply = client.completions.create(model=model, prompt=FRANCE, echo=True, max_tokens=0)
    assert reply.choices[0].text == FRANCE and reply.choices[0].finish_reason == "length"
    # What lm-evaluation-harness sends for loglikelihoods: several token-id prompts, logprobs=1 (and n=2 here).
    prompts = [prompt, _prompt_ids(served, FRANCE + " Paris")]
    reply = client.completions.create(model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0, n=2)
    assert len(reply.choices) == 4 and reply.usage.completion_tokens == 0
    first, longer = reply.choices[0].logprobs, reply.choices[2].logprobs
    assert reply.choices[0].text == FRANCE and reply.choices[2].text == FRANCE + " Paris"
    assert reply.choices[1].logprobs == first and reply.choices[3].logprobs == longer  # every choice gets them
    assert len(first.tokens) == len(prompt) and first.token_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(_reference_logprobs(prompt), abs=LOGPROB_TOLERANCE)
    assert longer.token_logprobs[:len(prompt)] == pytest.approx(first.token_logprobs, abs=1e-3)
    assert longer.tokens[-1] == " Paris" and longer.token_logprobs[-1] > -5  # the model knows it


def test_an_echoed_token_id_prompt_that_ends_inside_a_character_is_not_in_the_answer_twice(served, client, model):
    """Token ids that end within a character (lm-evaluation-harness cuts prompts by tokens): the generated text
    begins with that character whole, and the echo held it too, as U+FFFD: '東\ufffd京'. The echo now ends before
    it when tokens follow; with max_tokens 0 it is the ids' own text."""
    ids = _prompt_ids(served, "Repeat: 🙂 naïve 東京 東京")

    def text_of(token_ids):
        return httpx.post(f"{served.url}/detokenize", json={"tokens": token_ids}, timeout=60).json()["prompt"]

    cut = next(k for k in range(len(ids) - 1, 0, -1) if text_of(ids[:k]).endswith("\ufffd"))
    prompt = ids[:cut]
    whole = text_of(prompt)
    args = dict(model=model, prompt=prompt, max_tokens=4, temperature=0)
    answer = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(**args, echo=True).choices[0].text
    streamed = "".join(e.choices[0].text for e in client.completions.create(**args, echo=True, stream=True)
                       if e.choices)
    assert echoed == streamed == whole[:-1] + answer, (whole, answer, echoed)
    assert client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True).choices[0].text == whole


def test_streamed_echo_with_logprobs_equals_the_whole_reply(client, model):
    args = dict(model=model, prompt=FRANCE, echo=True, logprobs=2, max_tokens=3, temperature=0)
    whole = client.completions.create(**args).choices[0]
    text, tokens, token_logprobs, top_logprobs, offsets = "", [], [], [], []
    events = list(client.completions.create(stream=True, **args))
    assert events[0].choices[0].text == FRANCE  # the echoed prompt comes first, with its logprobs
    assert events[0].choices[0].logprobs.token_logprobs[0] is None
    for event in events:
        for choice in event.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                top_logprobs += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    # Within float32 noise: a request of an earlier test may still finish beside one of the two (tests/float_noise.py).
    assert floats_loosened(token_logprobs) == floats_loosened(whole.logprobs.token_logprobs)
    assert floats_loosened(top_logprobs) == floats_loosened(whole.logprobs.top_logprobs)
    zero = list(client.completions.create(stream=True, **{**args, "max_tokens": 0}))
    assert "".join(c.text for e in zero for c in e.choices) == FRANCE


def test_completion_top_logprobs_hold_the_token_itself(client, model):
    """Echoed "The sea is blue" with logprobs 1: " sea" is not the likeliest token after "The", yet a client that
    looks up each token in its top_logprobs finds it there (OpenAI's legacy format, as vLLM answers)."""
    reply = client.completions.create(model=model, prompt="The sea is blue", echo=True, logprobs=1, max_tokens=2,
                                      temperature=0)
    lp = reply.choices[0].logprobs
    assert lp.tokens[1] == " sea" and len(lp.top_logprobs[1]) == 2  # " sea", then the likeliest token
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and len(top) <= 2
        assert list(top)[0] == token  # the token first, as vLLM orders them
    zero = client.completions.create(model=model, prompt="The sea is blue", logprobs=0, max_tokens=2, temperature=0)
    lp = zero.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_chat_top_logprobs_are_the_n_likeliest_only(client, model):
    """Chat follows OpenAI's rule for chat: exactly top_logprobs entries, the sampled token not added."""
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=2.0, seed=1, max_tokens=8,
                                           logprobs=True, top_logprobs=1)
    content = reply.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 1 for entry in content)
    assert any(entry.top_logprobs[0].token != entry.token for entry in content)  # sampled off the top at least once
    none = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in none.choices[0].logprobs.content)


def test_logprobs_of_tokens_inside_a_character_rebuild_the_text(client, model):
    """SmolLM2 spends three tokens on 🎉 and two on some CJK characters: each such token's text is U+FFFD, but
    chat's `bytes` are the token's own (joined, they are the reply's UTF-8, what OpenAI documents them for), and
    completions' `text_offset` stays inside the text: a token starts where the characters before it end."""
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, logprobs=True,
                                           top_logprobs=2, extra_body={"structured_outputs": {"choice": ["🎉日本🎉"]}})
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == "🎉日本🎉"
    assert any(entry.token == "\ufffd" for entry in content)  # fragments there are
    assert b"".join(bytes(entry.bytes) for entry in content) == "🎉日本🎉".encode()
    assert all(top.bytes for entry in content for top in entry.top_logprobs)
    prompt = "日本語のテキスト: 🎉 and more"
    for stream in (False, True):
        args = dict(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0)
        if stream:
            events = list(client.completions.create(stream=True, **args))
            text = "".join(c.text for e in events for c in e.choices)
            tokens = [t for e in events for c in e.choices if c.logprobs for t in c.logprobs.tokens]
            offsets = [o for e in events for c in e.choices if c.logprobs for o in c.logprobs.text_offset]
        else:
            whole = client.completions.create(**args).choices[0]
            text, tokens, offsets = whole.text, whole.logprobs.tokens, whole.logprobs.text_offset
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), (offsets, len(text))  # <= : an EOS's
        for token, offset in zip(tokens, offsets):
            if "\ufffd" not in token and not token.startswith("<|"):  # a special token's text is not in the text
                assert text[offset:offset + len(token)] == token, (token, offset, text)
        assert text[offsets[tokens.index(" and")]:].startswith(" and more")
