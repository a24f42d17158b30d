"""Tool calling and reasoning end to end with the embedded model (the shipped Hermes template, auto tool choice,
the qwen3 reasoning parser) and the `openai` client, streamed and not: forced calls whose arguments validate
against their function's schema, a full round trip, OpenAI's streamed delta shape, reasoning_content."""
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import HERMES_TEMPLATE

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served_with_tools):
    return openai.OpenAI(base_url=served_with_tools.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _valid_calls(calls) -> list[str]:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in calls]


def _streamed(stream) -> tuple[dict, str, list]:
    """Tool calls put together from the deltas (checking OpenAI's shape), the finish reason, the first chunk."""
    calls, finish, chunks = {}, None, list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # first: id, type, name; arguments follow in pieces
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, finish, chunks


def test_named_function_whole_and_streamed(client, model):
    args = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**args)
    assert _valid_calls(reply.choices[0].message.tool_calls) == ["get_weather"]
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    calls, finish, chunks = _streamed(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(reply.choices[0].message.tool_calls[0].function.arguments)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.tool_calls  # the role comes with the first generated text


def test_required_with_two_tools_whole_and_streamed(client, model):
    args = dict(model=model, messages=[{"role": "user", "content": "What time is it in Tokyo, and the weather?"}],
                tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    reply = client.chat.completions.create(**args)
    names = _valid_calls(reply.choices[0].message.tool_calls)
    assert names and set(names) <= set(SCHEMAS) and reply.choices[0].finish_reason == "tool_calls"
    calls, finish, _ = _streamed(client.chat.completions.create(stream=True, parallel_tool_calls=False, **args))
    assert len(calls) == 1 and finish == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_allowed_tools_limit_the_calls_to_the_functions_named(client, model):
    """`tool_choice: {"type": "allowed_tools", ...}` (openai-python sends it; it was a 400): asked about the weather
    with only get_time allowed, `required` calls get_time, whole and streamed; the prompt carries only the allowed
    tools, with either mode."""
    only_time = {"type": "allowed_tools",
                 "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=only_time, max_tokens=60, temperature=0)
    reply = client.chat.completions.create(**args)
    assert _valid_calls(reply.choices[0].message.tool_calls) == ["get_time"] * len(reply.choices[0].message.tool_calls)
    assert reply.choices[0].finish_reason == "tool_calls"
    calls, finish, _ = _streamed(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls" and {c["name"] for c in calls.values()} == {"get_time"}
    alone = client.chat.completions.create(**{**args, "tools": TOOLS[1:], "tool_choice": "required"})
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens
    auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": TOOLS[1:]}}  # a whole definition
    answer = client.chat.completions.create(**{**args, "tool_choice": auto, "max_tokens": 1})
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens


@pytest.mark.parametrize("choice, words", [
    ({"mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]}, "'nope'"),
    ({"mode": "required", "tools": []}, "tool_choice"),
    ({"mode": "none", "tools": [{"type": "function", "function": {"name": "get_time"}}]}, "tool_choice"),
    ({"mode": "auto", "tools": [{"type": "mcp", "server_label": "x"}]}, "tool_choice"),
    ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}], "extra": 1}, "tool_choice"),
])
def test_bad_allowed_tools_are_400(served_with_tools, model, choice, words):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 1,
            "tool_choice": {"type": "allowed_tools", "allowed_tools": choice}}
    reply = httpx.post(f"{served_with_tools.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith("tool_choice") and words in error["message"] + error["param"], error
    no_tools = httpx.post(f"{served_with_tools.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": ASK, "max_tokens": 1,
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [TOOLS[0]]}}})
    assert no_tools.status_code == 400 and no_tools.json()["error"]["param"] == "tool_choice"


def test_tokenize_renders_the_tools_as_a_chat_request_does(served_with_tools, client, model):
    """/tokenize refused `tools` (vLLM takes them): a client counting a tool-using prompt's tokens could not."""
    url = f"{served_with_tools.url}/tokenize"
    with_tools = httpx.post(url, json={"model": model, "messages": ASK, "tools": TOOLS}).json()
    without = httpx.post(url, json={"model": model, "messages": ASK}).json()
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert with_tools["count"] == reply.usage.prompt_tokens > without["count"]
    bad = httpx.post(url, json={"model": model, "messages": ASK, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tools")


def test_auto_without_parallel_calls_answers_the_first_call_only(client, model):
    """`parallel_tool_calls: false` bounded only `required`: with `auto` a model that wrote two calls got both
    (the parser finds both in such a text: tests/test_tool_parsers.py). The two calls are forced with a regular
    expression, as any client can."""
    written = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>')
    args = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=80,
                extra_body={"structured_outputs": {"regex": re.escape(written)}})
    message = client.chat.completions.create(**args, parallel_tool_calls=False).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert not message.content
    calls, finish, _ = _streamed(client.chat.completions.create(stream=True, parallel_tool_calls=False, **args))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"


@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_a_forced_call_cut_off_by_max_tokens_is_no_content_whole_or_streamed(client, model, max_tokens):
    """The grammar's "[" and what follows are the call's text, never content: the whole answer says what the
    stream said (no content, finish "length")."""
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
                temperature=0)
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert not "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_round_trip_call_tool_answer(client, model):
    called = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=40, temperature=0)
    message = called.choices[0].message
    (call,) = message.tool_calls
    history = ASK + [message, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    choice = answer.choices[0]
    if choice.message.tool_calls:  # auto: the model may call again; then the calls are well formed
        _valid_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])  # DeepSeek's and older vLLM's; vLLM's now
def test_reasoning_whole_and_streamed_under_both_names(client, model, name):
    args = dict(model=model, messages=[{"role": "user", "content": "Is 17 a prime number?"}], max_tokens=12,
                temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    reply = client.chat.completions.create(**args).choices[0].message
    assert getattr(reply, name) and reply.content is None  # still thinking after 12 tokens
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = "".join(getattr(c.choices[0].delta, name, None) or "" for c in chunks if c.choices)
    assert streamed == getattr(reply, name)
    plain = client.chat.completions.create(**{**args, "extra_body": {}}).choices[0].message
    assert plain.content and getattr(plain, name) is None  # not opened: no reasoning


def test_continuing_a_message_whose_reasoning_is_open_goes_on_in_the_reasoning(client, model):
    """continue_final_message on `<think>Let me see`: the output is the rest of that reasoning, not content."""
    messages = [{"role": "user", "content": "Is 17 a prime number?"},
                {"role": "assistant", "content": "<think>Let me see"}]
    args = dict(model=model, messages=messages, max_tokens=6, temperature=0,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    reply = client.chat.completions.create(**args).choices[0].message
    assert reply.reasoning_content and reply.content is None, reply
    closed = [messages[0], {"role": "assistant", "content": "<think>hm</think>The answer"}]
    plain = client.chat.completions.create(**{**args, "messages": closed}).choices[0].message
    assert plain.content and plain.reasoning_content is None, plain


def test_bad_tool_requests_are_400(client, model):
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": TOOLS + TOOLS[:1]}, "same function name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          "tool_choice": "required"}, "frobnicate"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json_object": True}}, "cannot be combined"),
    ]
    for fields, words in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=fields)
        assert words in caught.value.body["message"]


def test_megabytes_of_tools_are_rendered_off_the_event_loop(served_with_tools, model):
    """The template renders the tools too: 7.7 MB of them beside one short message were rendered and tokenized in
    the event loop (1.1 s of it here, for every other client); measured with them, they go to the worker thread."""
    import httpx

    from tests.load import slowest_health_beside

    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "word " * 12_000,
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(128)]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools,
            "tool_choice": "none"}
    answer: list = []
    slowest = slowest_health_beside(served_with_tools.url, lambda: answer.append(
        httpx.post(f"{served_with_tools.base_url}/chat/completions", json=body, timeout=120)), every=0.02)
    assert answer[0].status_code == 400 and "maximum context length" in answer[0].json()["error"]["message"]
    assert slowest < 0.6, f"/health waited {slowest:.2f} s"


@pytest.mark.parametrize("written", [
    '<tool_call>\n{"name": "\\q", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": tru}}\n</tool_call>',
])
def test_a_call_whose_json_does_not_decode_is_content_not_a_500(client, model, written):
    """The model writes a tool call whose name holds an escape JSON has not (\\q): the scan takes it for a string,
    and json's own error, raised out of the parser, made a whole answer a 500 and ended a stream with an error.
    Arguments whose brackets close but whose values do not decode were sent as the call's `arguments`, which
    the client's json.loads then refused. (The output is forced with a regular expression, as any client can.)"""
    request = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=40,
                   extra_body={"structured_outputs": {"regex": re.escape(written)}})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content == written and not message.tool_calls
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == written
    # A call announced before its arguments broke stays sent (as in vLLM): a valid name is announced at once.
    assert chunks[-1].choices[0].finish_reason == ("stop" if "\\q" in written else "tool_calls")


def test_a_pythonic_call_pythons_parser_cannot_take_is_content_not_a_500(start_supervise):
    """`a=------1` as a pythonic call's argument: Python's parser raised MemoryError (a chain of operators past its
    stack), which escaped the tool-call parser: the whole answer was a 500 and the stream ended in an error."""
    server = start_supervise("--chat-template", HERMES_TEMPLATE, "--enable-auto-tool-choice",
                             "--tool-call-parser", "pythonic")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    written = "[get_weather(city=" + "-" * 3000 + "1)]"
    request = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=3100,
                   extra_body={"structured_outputs": {"regex": re.escape(written)}})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content == written and not message.tool_calls
    # Streamed, the call was announced at its "(" and stays sent (as in vLLM); the text follows as content.
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == written
    assert chunks[-1].choices[0].finish_reason in ("stop", "tool_calls")


def test_required_tools_from_pydantic_models_with_nested_models(client, model):
    """The openai client's pydantic_function_tool writes a nested model as `$defs` and `$ref: "#/$defs/..."` at the
    root of the parameters; the schema that forces the calls holds each tool's parameters deep inside it, where
    those references found nothing (400 "Pointer '/$defs/City' does not exist"). Two tools define `City`
    differently: each call must be valid against its own."""
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)

    class Trip(pydantic.BaseModel):
        origin: City
        stops: list[City] = pydantic.Field(max_length=2)

    class Zone(pydantic.BaseModel):  # another `City` in its own $defs
        class City(pydantic.BaseModel):
            code: int = pydantic.Field(ge=0, le=99)

        city: City

    models = {"Trip": Trip, "Zone": Zone}
    tools = [openai.pydantic_function_tool(Trip), openai.pydantic_function_tool(Zone)]
    assert all("$defs" in tool["function"]["parameters"] for tool in tools)
    messages = [{"role": "user", "content": "Plan a trip from Paris."}]
    for forced in ("required", {"type": "function", "function": {"name": "Zone"}}):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=forced,
                                               parallel_tool_calls=False, max_tokens=200, temperature=0)
        (call,) = reply.choices[0].message.tool_calls
        models[call.function.name].model_validate_json(call.function.arguments)
        assert reply.choices[0].finish_reason == "tool_calls"


def test_forced_calls_of_schemas_with_keywords_the_grammar_does_not_enforce(client, model):
    """pydantic writes `uniqueItems` for every set and `format: password` for a SecretStr; llguidance enforces
    neither, and refusing them (400 "Unimplemented keys") refused LangChain's `with_structured_output` of such a
    model and, under `tool_choice: required`, a whole tool list for one such tool. As vLLM does, they are left out
    of the constraint: the call is made and validates against the model."""
    class Palette(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        colors: set[str] = pydantic.Field(max_length=2)
        secret: pydantic.SecretStr = pydantic.Field(max_length=8)

    tool = openai.pydantic_function_tool(Palette)
    written = json.dumps(tool["function"]["parameters"])
    assert '"uniqueItems"' in written and '"password"' in written
    messages = [{"role": "user", "content": "Make a palette."}]
    for forced in ("required", {"type": "function", "function": {"name": "Palette"}}):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[tool, *TOOLS], tool_choice=forced,
                                               parallel_tool_calls=False, max_tokens=120, temperature=0)
        (call,) = reply.choices[0].message.tool_calls
        if call.function.name == "Palette":
            Palette.model_validate_json(call.function.arguments)
        else:
            _valid_calls([call])


def test_a_forced_call_of_a_function_whose_parameters_say_nothing_gets_an_object(client, model):
    """`parameters: {}` allows any JSON value, and the model answered `false`: arguments are always an object
    (OpenAI's, and what `fn(**json.loads(arguments))` needs)."""
    tool = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    for stream in (False, True):
        args = dict(model=model, messages=[{"role": "user", "content": "Say no."}], tools=[tool], max_tokens=80,
                    tool_choice={"type": "function", "function": {"name": "ping"}}, temperature=0)
        if stream:
            calls, finish, _ = _streamed(client.chat.completions.create(stream=True, **args))
            arguments = calls[0]["arguments"]
        else:
            choice = client.chat.completions.create(**args).choices[0]
            arguments, finish = choice.message.tool_calls[0].function.arguments, choice.finish_reason
        assert finish == "tool_calls" and isinstance(json.loads(arguments), dict), arguments


def test_a_forced_call_with_a_response_format_makes_the_call(client, model):
    """openai-agents sends its output type's schema with `tool_choice: required` (then lets the choice go once the
    tool ran); instructor's RESPONSES_TOOLS mode does the same. As in vLLM, the forced call's grammar wins: the
    reply is the call, valid against the tool's parameters; the format is for the answer after it."""
    answer_format = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                               response_format=answer_format, max_tokens=120, temperature=0)
        names = _valid_calls(reply.choices[0].message.tool_calls)
        assert names and reply.choices[0].finish_reason == "tool_calls"
        if isinstance(tool_choice, dict):
            assert names == ["get_time"]
    answer = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=200,
                                     temperature=0, parallel_tool_calls=False,
                                     tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
                                     tool_choice="required", text={"format": {"type": "json_schema", "name": "Answer",
                                                                              "schema": answer_format["json_schema"]["schema"]}})
    (call,) = [item for item in answer.output if item.type == "function_call"]
    assert answer.status == "completed", answer.output
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_reply_passed_back_with_the_client_libraries_keys_is_read(client, model):
    """Client libraries append a reply's message to the conversation as they hold it: LiteLLM with
    `provider_specific_fields`, the openai package's `parse()` with `parsed`, OpenAI's own replies with
    `annotations: []`, vLLM's newer replies with `reasoning`. Keys this server does not read are dropped, as vLLM
    drops them (each was a 400 on the conversation's second turn); the reasoning under its newer name is rendered
    as `reasoning_content` is. Keys of the request itself stay refused."""
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0).choices[0].message
    call = first.tool_calls[0]
    passed_back = {**first.model_dump(exclude_none=True), "provider_specific_fields": {"refusal": None},
                   "parsed": None, "annotations": [], "reasoning": "the user wants the weather"}
    passed_back["tool_calls"] = [{**passed_back["tool_calls"][0], "index": 0}]
    history = [{**ASK[0], "provider_specific_fields": {}},
               passed_back,
               {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "sunny",
                                                                      "cache_control": {"type": "ephemeral"}}]}]
    tokenize = httpx.post(str(client.base_url.join("/tokenize")), json={"model": model, "messages": history,
                                                                   "add_generation_prompt": True}, timeout=60)
    assert tokenize.status_code == 200, tokenize.text
    answer = client.chat.completions.create(model=model, messages=history, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    clean = [ASK[0], {"role": "assistant", "tool_calls": passed_back["tool_calls"],
                      "reasoning_content": "the user wants the weather"},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    same = httpx.post(str(client.base_url.join("/tokenize")), json={"model": model, "messages": clean,
                                                               "add_generation_prompt": True}, timeout=60)
    assert same.json()["tokens"] == tokenize.json()["tokens"]
    with pytest.raises(openai.BadRequestError, match="provider_specific_fields"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       extra_body={"provider_specific_fields": {}})
