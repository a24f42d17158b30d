"""Issue 4's surface against the real engine and the embedded model (the session's shared group): the
fields whose meaning depends on real sampling, checked where the simulated engine cannot tell."""
import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


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
