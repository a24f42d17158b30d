"""Every error through raw HTTP: the OpenAI error body with the right status, naming the field at fault;
never a 500 for bad input, never a traceback. And what clients see when the engine dies."""
import gzip
import json

import httpx
import openai
import pytest

from tests.supervise_process import Supervise

MODEL = "sim:2"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def sim():
    with Supervise("--model", MODEL, "--max-model-len", "512") as server:
        yield server


@pytest.fixture(scope="module")
def http(sim):
    with httpx.Client(base_url=sim.url, timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = "unchecked") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in response.text
    if param != "unchecked":
        assert body["error"]["param"] == param, body
    return body["error"]


def chat(http, **fields):
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **fields})


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe"])
def test_not_a_json_object(http, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/invocations"):
        assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("fields, param", [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),  # only an assistant message may leave it out
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # a tool message names its call
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    # A kind of choice is named by its `type`, and its own fields then (not the tag, nor the other kind's fields).
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "x", "tools": []}}},
     "tool_choice.allowed_tools.mode"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.allowed_tools"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (default true)
])
def test_bad_chat_fields_are_named(http, fields, param):
    response = chat(http, **fields)
    if param is None:
        assert response.status_code == 200
    else:
        assert_error(response, 400, param)


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]),
                                          ("prediction", {"type": "content", "content": "x"}), ("audio", {"voice": "x"}), ("frobnicate", 1)])
def test_unsupported_and_unknown_fields_are_refused_by_name(http, field, value):
    error = assert_error(chat(http, **{field: value}), 400, field)
    assert field in error["message"]


def test_unsupported_fields_sent_as_null_pass(http):
    assert chat(http, max_tokens=1, tools=None, logit_bias=None, functions=None).status_code == 200


def test_unsupported_fields_at_values_that_ask_for_nothing_pass(http):
    """What some clients send by default (legacy LangChain: logit_bias {}); anything more is still refused."""
    response = chat(http, max_tokens=1, logit_bias={}, functions=[], metadata={"team": "search"}, service_tier="auto")
    assert response.status_code == 200, response.text
    # What the openai package, LangChain, llama-index and openai-agents forward when a user sets them: text only,
    # the default verbosity, a cache hint, `store` (nothing is stored), no stream padding (none is made anyway).
    response = chat(http, max_tokens=1, modalities=["text"], verbosity="medium", prompt_cache_retention="24h",
                    store=True, stream=True, stream_options={"include_obfuscation": False})
    assert response.status_code == 200, response.text
    assert chat(http, max_tokens=1, verbosity=None, store=False).status_code == 200
    assert_error(chat(http, max_tokens=1, stream=True, stream_options={"include_obfuscation": "no"}), 400,
                 "stream_options.include_obfuscation")
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "best_of": 1})
    assert response.status_code == 200, response.text
    too_many = {f"k{i}": "v" for i in range(17)}  # OpenAI's metadata holds at most 16 pairs
    for field, value in (("service_tier", "flex"), ("functions", [{"name": "f"}]), ("metadata", {"n": 1}),
                         ("metadata", too_many), ("modalities", ["audio"]), ("modalities", ["text", "audio"]),
                         ("verbosity", "high"), ("prompt_cache_retention", "forever"), ("store", "yes")):
        assert field in assert_error(chat(http, **{field: value}), 400)["param"]
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 2}), 400, "best_of")


# vLLM's request fields at the values that ask for nothing, as clients built on vLLM's request classes (and
# proxies that forward every field) send them; each with a value that asks for something, refused by name.
VLLM_FIELDS_AT_REST = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
                       "truncate_prompt_tokens": None, "prompt_logprobs": None, "allowed_token_ids": None,
                       "bad_words": [], "return_tokens_as_token_ids": False, "return_token_ids": False,
                       "cache_salt": None, "logits_processors": None, "kv_transfer_params": None, "vllm_xargs": {},
                       "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
                       "guided_decoding_backend": None, "guided_whitespace_pattern": None}
VLLM_CHAT_FIELDS_AT_REST = {"echo": False, "add_special_tokens": False, "documents": None, "chat_template": None,
                            "mm_processor_kwargs": {}}
VLLM_FIELDS_ASKING = [("use_beam_search", True), ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
                      ("prompt_logprobs", 1), ("allowed_token_ids", [1, 2]),
                      ("bad_words", ["x"]), ("return_tokens_as_token_ids", True), ("return_token_ids", True),
                      ("cache_salt", "s"), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}),
                      ("echo", True), ("add_special_tokens", True), ("documents", [{"text": "x"}]),
                      ("chat_template", "{{ messages }}"), ("guided_json", {"type": "object"}),
                      ("guided_choice", ["a"])]


def test_vllms_own_fields_pass_at_rest_and_are_refused_by_name_otherwise(http):
    response = chat(http, max_tokens=1, **VLLM_FIELDS_AT_REST, **VLLM_CHAT_FIELDS_AT_REST)
    assert response.status_code == 200, response.text
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                  "add_special_tokens": True, **VLLM_FIELDS_AT_REST})
    assert response.status_code == 200, response.text
    for field, value in VLLM_FIELDS_ASKING:
        error = assert_error(chat(http, max_tokens=1, **{field: value}), 400, field)
        assert error["message"].startswith(f"Unsupported value for `{field}`: "), error
        if field.startswith("guided_"):
            assert "`structured_outputs`" in error["message"]
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "add_special_tokens": False}),
                 400, "add_special_tokens")
    # A completion's own `echo` keeps its own error (the chat's reason was given for it).
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": "yes"}), 400, "echo")
    assert "chat" not in error["message"], error


def test_an_image_or_audio_part_says_the_server_reads_text_only(http):
    for part in ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio"}, {"type": "file"}):
        error = assert_error(chat(http, messages=[{"role": "user", "content": [part]}]), 400, "messages.0.content.0.type")
        assert "text only" in error["message"], error


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http):
    """vLLM's `truncate_prompt_tokens`: only the prompt's last k tokens run (-1: up to the model's length), so a
    client can send a history longer than the context; an echo shows the tokens kept. 0 and more than the model's
    length are 400s naming it."""
    ids = list(range(100, 700))  # 600 tokens: past this group's --max-model-len 512
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}).status_code == 400
    kept = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True,
                                              "truncate_prompt_tokens": 10})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 10, kept.text
    alone = http.post("/v1/completions", json={"model": MODEL, "prompt": ids[-10:], "max_tokens": 0, "echo": True})
    assert kept.json()["choices"][0]["text"].startswith(alone.json()["choices"][0]["text"])
    whole = http.post("/v1/completions", json={"model": MODEL, "prompt": ids[:20], "max_tokens": 1,
                                               "truncate_prompt_tokens": -1})
    assert whole.json()["usage"]["prompt_tokens"] == 20
    batch = http.post("/v1/completions", json={"model": MODEL, "prompt": [ids, ids[:3]], "max_tokens": 1,
                                               "truncate_prompt_tokens": 5})
    assert batch.json()["usage"]["prompt_tokens"] == 5 + 3, batch.text  # each prompt alike; a short one whole
    chat_kept = chat(http, max_tokens=1, truncate_prompt_tokens=3)
    assert chat_kept.status_code == 200 and chat_kept.json()["usage"]["prompt_tokens"] == 3, chat_kept.text
    for value in (0, 513, -2, "5"):
        assert_error(chat(http, max_tokens=1, truncate_prompt_tokens=value), 400, "truncate_prompt_tokens")


def test_a_body_after_a_utf8_byte_order_mark_is_read(http):
    """PowerShell 5's `Out-File -Encoding utf8` writes one; Python's json (and so vLLM) reads past it."""
    body = b"\xef\xbb\xbf" + json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 1}).encode()
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert_error(http.post("/v1/chat/completions", content=b"\xef\xbb\xbf", headers={"content-type": "application/json"}), 400)


def test_the_labels_newer_openai_clients_send_pass(sim, http):
    """`prompt_cache_key` and `safety_identifier` label a request and ask for nothing; the openai package sends
    them as it sends `user`. `verbosity` asks for shorter or longer answers: still refused by name."""
    client = openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=30)
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, prompt_cache_key="tenant-7",
                                            safety_identifier="user-1b2c")
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                  "prompt_cache_key": "k", "safety_identifier": "s"})
    assert response.status_code == 200, response.text
    for field, value in (("prompt_cache_key", "k" * 1025), ("safety_identifier", 7), ("verbosity", "low")):
        assert_error(chat(http, max_tokens=1, **{field: value}), 400, field)


def test_stream_options_only_with_a_stream(http):
    error = assert_error(chat(http, max_tokens=1, stream_options={"include_usage": True}), 400, "stream_options")
    assert "stream" in error["message"]
    assert chat(http, max_tokens=1, stream=True, stream_options={"include_usage": True}).status_code == 200


def _events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": HELLO}),
                                        ("/v1/completions", {"prompt": "hello", "echo": True})])
def test_usage_in_every_chunk_when_asked(http, path, body):
    """vLLM's `continuous_usage_stats` (with `include_usage`), which guidellm and aiperf send with every stream
    (refused before: guidellm's every request failed): each chunk carries the usage so far; the last chunk is the
    whole usage, as without it. Without `include_usage` it asks for nothing, as in vLLM."""
    body = {"model": MODEL, **body, "max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True}
    asked = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(http, path, {**body, "stream_options": asked})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert chunks and all("usage" in chunk and chunk["choices"] for chunk in chunks), chunks
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert {chunk["usage"]["prompt_tokens"] for chunk in events} == {last["usage"]["prompt_tokens"]}
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in events)
    for options in ({"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": None}):
        events = _events(http, path, {**body, "stream_options": options})
        assert [chunk for chunk in events if "usage" in chunk] == ([events[-1]] if options.get("include_usage") else [])


def test_a_lone_surrogate_escape_is_named(http):
    """JSON.stringify writes one for a string cut inside an emoji; the 400 says what it is."""
    body = b'{"model": "sim:2", "messages": [{"role": "user", "content": "cut \\ud83d"}]}'
    error = assert_error(http.post("/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json"}), 400)
    assert "surrogate pair" in error["message"]


def test_json_nested_past_the_parsers_depth_is_named(http):
    """A JSON schema nested 150 objects deep is valid JSON: the 400 says it is too deep, not that it is invalid."""
    schema = '{"type": "object", "properties": {"x": ' * 150 + '{"type": "string"}' + "}}" * 150
    body = ('{"model": "sim:2", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
            '"json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}}")
    error = assert_error(http.post("/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json"}), 400)
    assert "deeper" in error["message"] and "not valid JSON" not in error["message"]


def test_null_is_the_default_where_openai_says_or_null(http):
    """SDKs that write every field send null for what was left unset: each such field reads as left out."""
    nulls = dict.fromkeys(("n", "stream", "logprobs", "ignore_eos", "min_tokens", "priority", "skip_special_tokens",
                           "include_stop_str_in_output", "add_generation_prompt", "continue_final_message"))
    response = chat(http, max_tokens=2, stream_options=None, **nulls)
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": None,
                                                  "stream": None, "echo": None})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1 and response.json()["usage"]["prompt_tokens"] == 1
    tokens = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": None})
    assert tokens.status_code == 200 and tokens.json()["count"] == 1
    assert_error(chat(http, n=0), 400, "n")  # a value is still checked


def test_the_default_completion_budget_shrinks_to_the_room_left(http):
    """OpenAI's default of 16 tokens was not asked for: a prompt 2 tokens short of the context gets 2, not a 400
    blaming "16 in the completion"; asked for explicitly, 16 is still refused, and a full prompt always."""
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [100] * 510})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "length"
    short = http.post("/v1/completions", json={"model": MODEL, "prompt": [100] * 10, "ignore_eos": True}).json()
    assert short["usage"]["completion_tokens"] == 16
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [100] * 510, "max_tokens": 16}),
                         400, "max_tokens")
    assert "16 in the completion" in error["message"]
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [100] * 512}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_a_whole_response_too_large_for_its_logprobs_is_refused_before_it_runs(http):
    """n=128 with 20 top logprobs over 400 tokens could hold 1,075,200 entries (--max-logprob-entries: 1,000,000),
    some 400 MB of the API server's memory before the body is written: a 400 naming the way out. Streamed, the
    same request keeps none (each event goes as it comes) and runs; fewer tokens fit."""
    big = {"n": 128, "logprobs": True, "top_logprobs": 20, "max_tokens": 400}
    error = assert_error(chat(http, **big), 400, "top_logprobs")
    assert "1,075,200 logprob entries" in error["message"] and "Stream it" in error["message"]
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 128, "logprobs": 20,
                                                            "max_tokens": 400}), 400, "logprobs")
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **big, "stream": True}) \
            as streamed:
        assert streamed.status_code == 200
        assert next(streamed.iter_lines()).startswith("data: ")
    assert chat(http, **{**big, "max_tokens": 3}).status_code == 200


def test_model_left_out_is_the_served_one_and_an_unknown_one_is_404(http):
    """vLLM's reading (OpenAI requires `model`): a body without one, or with null, asks for the served model."""
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "x"})):
        for model in ({}, {"model": None}):
            response = http.post(path, json={**body, **model, "max_tokens": 2})
            assert response.status_code == 200 and response.json()["model"] == MODEL, response.text
    assert_error(chat(http, model=7), 400, "model")
    error = assert_error(chat(http, model="gpt-4"), 404, "model")
    assert "gpt-4" in error["message"] and error["code"] == "model_not_found"
    assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [49152]}, "prompt"),  # outside the vocabulary
    ({"prompt": [-1]}, "prompt.0"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
])
def test_bad_completion_fields(http, fields, param):
    assert_error(http.post("/v1/completions", json={"model": MODEL, **fields}), 400, param)


def test_prompt_longer_than_the_model_allows(http):
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 600}), 400)
    assert "maximum context length is 512" in error["message"] and error["code"] == "context_length_exceeded"
    error = assert_error(chat(http, max_tokens=600), 400, "max_tokens")
    assert "maximum context length" in error["message"]


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)
    assert_error(http.delete("/v1/models"), 405)


def test_stream_too_gets_errors_before_it_starts(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "stream": True, "n": 0})
    assert_error(response, 400, "n")


def test_engine_death_is_503_and_health_follows(start_supervise):
    # The simulated engine's loop raises on a request id containing `sim-engine-die`, as a real engine bug
    # would: it tells every API server ENGINE_DEAD, then exits; the supervisor then takes the group down.
    group = start_supervise("--model", MODEL)
    body = {"model": MODEL, "messages": HELLO, "request_id": "sim-engine-die-1"}
    response = httpx.post(f"{group.base_url}/chat/completions", json=body, timeout=30)
    error = assert_error(response, 503)
    assert error["type"] == "service_unavailable_error"
    try:
        health = httpx.get(f"{group.url}/health", timeout=5)
        assert health.status_code == 503
        assert_error(httpx.post(f"{group.base_url}/chat/completions", json={"model": MODEL, "messages": HELLO}, timeout=5), 503)
    except httpx.TransportError:
        pass  # the supervisor already took the group down: as good as a 503 for a load balancer
    assert group.wait_exit(60) != 0


def test_engine_death_mid_stream_is_an_error_event(start_supervise):
    group = start_supervise("--model", "sim:20")
    body = {"model": "sim:20", "messages": HELLO, "stream": True, "max_tokens": 500, "ignore_eos": True}
    with httpx.stream("POST", f"{group.base_url}/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        killer = {"model": "sim:20", "messages": HELLO, "request_id": "sim-engine-die-2"}
        httpx.post(f"{group.base_url}/chat/completions", json=killer, timeout=30)
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "service_unavailable_error" in events[-2]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 1}),
    ("/invocations", {"messages": HELLO, "max_tokens": 1}),
    ("/tokenize", {"model": MODEL, "prompt": "x"}),
    ("/detokenize", {"model": MODEL, "tokens": [1]}),
])
def test_a_compressed_body_is_a_415_and_an_uncompressed_one_passes(http, path, body):
    """A gzipped JSON body was a 400 "not valid JSON at column 1"; the client needs to hear that the server
    reads bodies uncompressed (RFC 7694: 415 with Accept-Encoding)."""
    raw = json.dumps(body).encode()
    for encoding, sent in (("gzip", gzip.compress(raw)), ("br", raw), ("gzip, identity", gzip.compress(raw))):
        response = http.post(path, content=sent, headers={"content-type": "application/json",
                                                          "content-encoding": encoding})
        error = assert_error(response, 415, None)
        assert error["code"] == "unsupported_content_encoding" and "Content-Encoding" in error["message"]
        assert response.headers["accept-encoding"] == "identity"
    for encoding in ("identity", "IDENTITY", "", "identity, identity"):
        response = http.post(path, content=raw, headers={"content-type": "application/json",
                                                         "content-encoding": encoding})
        assert response.status_code == 200, response.text
    # A list split over two lines: the second line's gzip counts as much as the first line's identity.
    response = http.post(path, content=gzip.compress(raw), headers=[("content-type", "application/json"),
                                                                   ("content-encoding", "identity"),
                                                                   ("content-encoding", "gzip")])
    assert assert_error(response, 415, None)["code"] == "unsupported_content_encoding"


def test_a_responses_stream_that_fails_ends_with_response_failed(sim):
    """A failure mid-stream ended the Responses stream with an `error` event alone: a client waiting for the
    response's terminal event (the openai package's stream helper, agents' runners) never got one. Now the error
    event is followed by `response.failed`, OpenAI's, whose response says why."""
    client = openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=30)
    with client.responses.stream(model=MODEL, input="hello", max_output_tokens=8,
                                 extra_headers={"X-Request-Id": "sim-request-error-responses"}) as stream:
        events = list(stream)
        with pytest.raises(RuntimeError):
            stream.get_final_response()  # only a completed response is final
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    error, failed = events[-2:]
    assert error.type == "error" and error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and failed.response.error.message == error.message
    assert [event.sequence_number for event in events] == list(range(len(events)))
    type(failed.response).model_validate(failed.response.model_dump())  # as the openai package's types require
