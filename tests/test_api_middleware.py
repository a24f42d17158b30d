"""Middleware and headers: CORS, the API key, X-Request-Id echo, and user middleware (--middleware)."""
import os

import httpx
import pytest

from tests.supervise_process import Supervise

MODEL = "sim:2"
KEY = "s3cret-key"
OLD_KEY = "the-key-being-rotated-out"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


class StampMiddleware:
    """A user middleware class (ASGI): adds a header to every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def stamped(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"class")]
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_function(request, call_next):
    """A user middleware function, as vLLM's --middleware takes it."""
    response = await call_next(request)
    response.headers["x-stamp-fn"] = "function"
    return response


@pytest.fixture(scope="module")
def guarded():
    with Supervise(
        "--model", MODEL, "--api-key", KEY, "--api-key", OLD_KEY, "--allowed-origins", '["https://app.example"]',
        "--enable-request-id-headers",
        "--middleware", "tests.test_api_middleware:StampMiddleware",
        "--middleware", "tests.test_api_middleware:stamp_function",
        env={"PYTHONPATH": REPO},
    ) as server:
        yield server


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("POST", "/invocations", CHAT),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
])
def test_api_key_guards_the_model_and_tokenizer(guarded, method, path, body):
    url = guarded.url + path
    two = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")]  # which one would a proxy read?
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, two):
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.request(method, url, json=body, headers=auth(), timeout=30).status_code == 200
    assert httpx.request(method, url, json=body, headers=auth(OLD_KEY), timeout=30).status_code == 200  # either


@pytest.mark.parametrize("path", ["/health", "/ping", "/metrics", "/version", "/openapi.json", "/docs"])
def test_probes_stay_open(guarded, path):
    assert httpx.get(guarded.url + path, timeout=10).status_code == 200


def test_cors(guarded):
    allowed = httpx.get(guarded.url + "/v1/models", headers={"Origin": "https://app.example", **auth()}, timeout=10)
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(guarded.url + "/v1/models", headers={"Origin": "https://evil.example", **auth()}, timeout=10)
    assert "access-control-allow-origin" not in other.headers
    preflight = httpx.options(guarded.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })
    assert preflight.status_code == 200  # no API key needed for the preflight
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"


def test_a_refused_preflight_is_400_in_the_openai_format(guarded):
    for origin, method, refused in (("https://evil.example", "POST", "origin"), ("https://app.example", "BREW", "method")):
        preflight = httpx.options(guarded.url + "/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": method,
        })
        assert preflight.status_code == 400
        assert preflight.headers["content-type"] == "application/json"
        assert "access-control-allow-methods" in preflight.headers  # the CORS headers are still there
        error = preflight.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == "cors_disallowed"
        assert error["message"].startswith(f"Disallowed CORS {refused}:") and "--allowed-origins" in error["message"]


def test_request_id_header_is_echoed_and_used(guarded):
    response = httpx.post(guarded.base_url + "/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-1", **auth()}, timeout=30)
    assert response.headers["x-request-id"] == "abc-1"
    assert response.json()["id"] == "chatcmpl-abc-1"
    fresh = httpx.get(guarded.url + "/health", timeout=10).headers["x-request-id"]
    assert len(fresh) >= 16


@pytest.mark.parametrize("path, body, prefix", [
    ("/chat/completions", CHAT, "chatcmpl-"),
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, "cmpl-"),
    ("/chat/completions", {**CHAT, "stream": True}, "chatcmpl-"),
])
def test_the_echoed_request_id_is_the_one_the_request_went_by(guarded, path, body, prefix):
    """Without the header, the body's `request_id` is the id (as without the echo), and the header sent back says
    so; the header still wins over the body's; a header longer than the body's limit is refused like it."""
    by_body = httpx.post(guarded.base_url + path, json={**body, "request_id": "from-body"}, headers=auth(), timeout=30)
    assert by_body.status_code == 200, by_body.text
    assert by_body.headers["x-request-id"] == "from-body"
    assert f'"id":"{prefix}from-body"' in by_body.text.replace(" ", "")
    by_header = httpx.post(guarded.base_url + path, json={**body, "request_id": "from-body"},
                           headers={"X-Request-Id": "from-header", **auth()}, timeout=30)
    assert by_header.headers["x-request-id"] == "from-header"
    assert f'"id":"{prefix}from-header"' in by_header.text.replace(" ", "")
    too_long = httpx.post(guarded.base_url + path, json=body, headers={"X-Request-Id": "r" * 257, **auth()}, timeout=30)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "x-request-id"


def test_user_middleware_class_and_function(guarded):
    response = httpx.get(guarded.url + "/health", timeout=10)
    assert response.headers["x-stamp"] == "class"
    assert response.headers["x-stamp-fn"] == "function"


def test_api_key_from_the_environment_and_no_cors_by_default(start_supervise):
    group = start_supervise("--model", MODEL, env={"SUPERVISE_API_KEY": f"{KEY} {OLD_KEY}"})  # two, as a rotation
    assert httpx.get(group.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(group.url + "/v1/models", headers=auth(OLD_KEY), timeout=10).status_code == 200
    assert httpx.get(group.url + "/v1/models", headers=auth(f"{KEY} {OLD_KEY}"), timeout=10).status_code == 401
    response = httpx.get(group.url + "/v1/models", headers={"Origin": "https://app.example", **auth()}, timeout=10)
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    assert "x-request-id" not in response.headers  # echo is off by default
