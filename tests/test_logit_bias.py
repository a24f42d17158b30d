"""OpenAI's `logit_bias` against the real engine and the embedded model: -100 bans a token, +100 makes it the
only choice, only in the request that asks; logprobs stay the model's; bad maps are a 400 naming the field."""
import concurrent.futures

import httpx
import pytest

from tests.test_api_errors import assert_error
from tests.test_api_real_model import QUESTION, client, model  # noqa: F401  (the shared group's client and model)


@pytest.fixture(scope="module")
def yes(served, model) -> int:
    """The id of " yes", a token the answer to QUESTION does not hold."""
    (token,) = httpx.post(f"{served.url}/tokenize", json={"model": model, "prompt": " yes"}).json()["tokens"]
    return token


def greedy(client, model, **extra):
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8, **extra)
    return reply.choices[0].message.content


def test_a_bias_of_100_makes_its_token_every_token_chat_and_completions(client, model, yes):
    assert " yes" not in greedy(client, model)
    assert greedy(client, model, logit_bias={str(yes): 100}) == " yes" * 8
    sampled = client.chat.completions.create(model=model, messages=QUESTION, temperature=1.0, n=2, max_tokens=5,
                                             logit_bias={str(yes): 100}, seed=3)
    assert [c.message.content for c in sampled.choices] == [" yes" * 5] * 2
    chunks = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                       logit_bias={str(yes): 100}, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == " yes" * 4


def test_a_bias_of_minus_100_bans_the_answers_first_token(served, client, model):
    plain = greedy(client, model)
    tokens = httpx.post(f"{served.url}/tokenize", json={"model": model, "prompt": plain}).json()["tokens"]
    banned = greedy(client, model, logit_bias={str(tokens[0]): -100})
    assert banned != plain
    again = httpx.post(f"{served.url}/tokenize", json={"model": model, "prompt": banned}).json()["tokens"]
    assert again[0] != tokens[0]


def test_logprobs_stay_the_models_own(client, model, yes):
    """As vLLM reports them: the raw distribution's, before the bias (the forced token was unlikely)."""
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=2,
                                           logprobs=True, top_logprobs=2, logit_bias={str(yes): 100})
    (first, second) = reply.choices[0].logprobs.content
    assert first.token == " yes" and first.logprob < -5
    assert all(top.token != " yes" and top.logprob > first.logprob for top in first.top_logprobs)


def test_a_bias_changes_only_its_own_request_in_a_batch(client, model, yes):
    plain = greedy(client, model)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        asked = [pool.submit(greedy, client, model, **({"logit_bias": {str(yes): 100}} if i % 2 else {}))
                 for i in range(6)]
        answers = [a.result() for a in asked]
    assert answers == [plain, " yes" * 8] * 3


@pytest.mark.parametrize("bias, param", [
    ({"abc": 1}, "logit_bias"), ({"-1": 1}, "logit_bias"), ({"1e3": 1}, "logit_bias"), ({" 5": 1}, "logit_bias"),
    ({"٥": 1}, "logit_bias"), ({"49152": 1}, "logit_bias"), ({"9" * 5000: 1}, "logit_bias"),
    ({"5": 101}, "logit_bias"), ({"5": -100.5}, "logit_bias"), ({"5": "1"}, "logit_bias.5"),
    ({"5": True}, "logit_bias.5"), ({"5": None}, "logit_bias.5"), ([5], "logit_bias"), ("5", "logit_bias"),
    ({str(i): 1 for i in range(1025)}, "logit_bias"),
])
def test_bad_biases_are_a_400_naming_the_field(served, model, bias, param):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "x"})):
            response = http.post(path, json={"model": model, "max_tokens": 1, "logit_bias": bias, **body})
            error = assert_error(response, 400, param)
            assert "logit_bias" in error["message"]
            if len(bias) > 1000:
                assert "--max-logit-bias-entries" in error["message"]


def test_maps_that_ask_for_nothing_and_repeated_ids_pass(served, client, model, yes):
    """{} and null (what some SDKs send by default); "05" and "5" are one token, the last one given wins."""
    plain = greedy(client, model)
    assert greedy(client, model, logit_bias={}) == plain
    body = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 8, "logit_bias": None}
    assert httpx.post(f"{served.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] \
        == plain
    assert greedy(client, model, logit_bias={"0" + str(yes): -100, str(yes): 100}) == " yes" * 8


def test_the_entries_limit_is_the_flags(start_supervise):
    group = start_supervise("--model", "sim:2", "--max-logit-bias-entries", "2")
    with httpx.Client(base_url=group.url, timeout=30) as http:
        def chat(bias):
            return http.post("/v1/chat/completions", json={"model": "sim:2", "messages": QUESTION, "max_tokens": 1,
                                                           "logit_bias": bias})
        assert chat({"5": 1, "6": -1}).status_code == 200
        error = assert_error(chat({"5": 1, "6": -1, "7": 2}), 400, "logit_bias")
        assert "at most 2" in error["message"] and "--max-logit-bias-entries" in error["message"]
