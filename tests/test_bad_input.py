"""Bad requests through raw HTTP: the OpenAI error body, 400/404, never a 500 or a traceback."""
import httpx
import pytest


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    assert "Traceback" not in response.text
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json(http, path):
    response = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_wrong_types(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    response = http.post("/v1/chat/completions", json={"model": model, "messages": "hello", "max_tokens": "ten"})
    assert_openai_error(response, 400)


def test_a_model_that_is_no_string(http):
    response = http.post("/v1/completions", json={"model": ["m"], "prompt": "hi"})
    assert assert_openai_error(response, 400)["param"] == "model"


def test_unknown_model(http):
    response = http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    error = assert_openai_error(response, 404)
    assert "nope" in error["message"]


def test_negative_max_tokens(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    response = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": -1})
    assert_openai_error(response, 400)


def test_prompt_longer_than_the_model_allows(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    response = http.post("/v1/completions", json={"model": model, "prompt": "word " * 20000, "max_tokens": 5})
    assert_openai_error(response, 400)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_number_that_is_not_finite_is_named_so(http, value):
    """Python's json.dumps writes float("nan") as NaN, which is not JSON; a client that sends it learns what is
    wrong, not that the value is past the field's bound."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": %s}' % (model.encode(), value)
    error = assert_openai_error(http.post("/v1/completions", content=body,
                                          headers={"content-type": "application/json"}), 400)
    assert error["param"] == "temperature" and "finite number" in error["message"], error


def test_json_array_body(http):
    response = http.post("/v1/chat/completions", json=[1, 2, 3])
    assert_openai_error(response, 400)


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("content", ["null", "absent", "no parts"])
def test_a_message_without_content_is_refused_unless_it_is_the_assistants(http, role, content):
    """OpenAI answers 400 for a user, system or tool message whose content is null, missing or an empty list of
    parts; it had been read as an empty message and answered. An empty string stays an empty message."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    message = {"role": role, **({"content": None} if content == "null" else {"content": []} if content == "no parts"
                                else {}), **({"tool_call_id": "call_1"} if role == "tool" else {})}
    messages = [{"role": "user", "content": "Hi"}, message] if role == "tool" else [message]
    response = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2})
    error = assert_openai_error(response, 400)
    where = len(messages) - 1
    assert error["param"] == f"messages.{where}.content" and f"a {role} message needs content" in error["message"]


def test_an_assistant_turn_may_come_without_content(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": ""}, {"role": "user", "content": "Say yes."}]
    response = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
