"""Issue 2's promise, as a user checks it: the embedded model, 2 API servers, the official openai client."""
import concurrent.futures

import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_embedded_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_answers_paris(client):
    reply = client.chat.completions.create(model=model_name(client), messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 10


def test_streamed_chat_answers_paris(client):
    stream = client.chat.completions.create(
        model=model_name(client), messages=QUESTION, temperature=0, max_tokens=20, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "Paris" in "".join(pieces)
    assert len([p for p in pieces if p]) > 3  # it really streamed, token by token


def test_streamed_and_plain_answers_agree_at_temperature_0(client):
    name = model_name(client)
    plain = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=16, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == plain.choices[0].message.content


def test_completions_endpoint(client):
    reply = client.completions.create(
        model=model_name(client), prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert "Paris" in reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_max_tokens_bounds_the_answer(client):
    reply = client.chat.completions.create(
        model=model_name(client), messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=7
    )
    assert reply.usage.completion_tokens == 7
    assert reply.choices[0].finish_reason == "length"


def test_concurrent_requests_all_complete(client):
    name = model_name(client)

    def ask(i: int) -> str:
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"Count to {i + 3}."}], temperature=0.7, max_tokens=24
        )
        return reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    assert len(answers) == 12 and all(answers)


def test_unknown_model_is_404_in_openai_format(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=QUESTION, max_tokens=5)
    assert caught.value.status_code == 404
    assert caught.value.body["message"]


def test_missing_messages_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name(client), messages=None, max_tokens=5)
