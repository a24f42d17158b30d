"""POST /v1/responses (OpenAI's Responses API, stateless) end to end with the embedded model and the `openai`
client, as an application uses it: text, whole and streamed; a conversation passed back as the earlier
response's output items; forced function calls and their outputs; a cut-off answer; and what is refused."""
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.supervise_process import Supervise
from tests.test_tool_calling import WEATHER

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _streamed(stream_manager) -> tuple[list, object]:
    with stream_manager as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_text_whole_and_streamed(served):
    client = _client(served)
    args = dict(model=MODEL, input="Name a colour.", instructions="Answer in one word.", max_output_tokens=12,
                temperature=0)
    whole = client.responses.create(**args)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == "completed"
    assert whole.output_text.strip() and [item.type for item in whole.output] == ["message"]
    assert whole.output[0].role == "assistant" and whole.output[0].status == "completed"
    assert (whole.temperature, whole.top_p, whole.tool_choice) == (0, 1, "auto")  # as sampled; OpenAI's default
    unset = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=1)
    assert (unset.temperature, unset.top_p) == (1, 1)  # the embedded model's generation_config.json sets neither
    usage = whole.usage
    assert usage.input_tokens > 10 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cache_write_tokens == 0  # a field the openai package requires
    type(whole).model_validate(whole.model_dump())  # every field its types require, of the right type
    assert whole.instructions == "Answer in one word." and whole.store is False
    assert whole.completed_at >= whole.created_at
    # Fields that ask for nothing done here: a cache hint, no compaction, the default verbosity.
    same = client.responses.create(**args, prompt_cache_retention="in_memory", text={"verbosity": "medium"},
                                   extra_body={"context_management": None})
    assert same.output_text == whole.output_text

    events, final = _streamed(client.responses.stream(**args))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == usage.output_tokens and final.status == "completed"


def test_cut_off_by_max_output_tokens(served):
    client = _client(served)
    args = dict(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3)
    whole = client.responses.create(**args)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.completed_at is None
    assert whole.usage.output_tokens == 3 and whole.output[-1].status == "incomplete"
    # OpenAI's own end for it; the client's stream helper waits for response.completed, so the raw events.
    events = list(client.responses.create(stream=True, **args))
    assert [event.type for event in events if event.type.startswith("response.") and "." not in event.type[9:]] == [
        "response.created", "response.in_progress", "response.incomplete"]
    final = events[-1].response
    assert final.status == "incomplete" and final.output[-1].status == "incomplete"
    assert final.usage.output_tokens == 3


def test_conversation_passed_back(served):
    """The documented way to go on without stored state: the earlier output items, as the client got them, in
    the next request's input."""
    client = _client(served)
    turn = [{"role": "user", "content": "My name is Ada. Say hello."}]
    first = client.responses.create(model=MODEL, input=turn, max_output_tokens=16, temperature=0)
    history = turn + first.output + [{"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}]
    second = client.responses.create(model=MODEL, input=history, max_output_tokens=16, temperature=0)
    assert second.output_text.strip()
    # The earlier turn reached the prompt: the answer it got is in the second prompt's tokens.
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens


def test_forced_function_call_and_its_output(served_with_tools):
    client = _client(served_with_tools)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model=MODEL, input=ask, tools=[WEATHER_TOOL], max_output_tokens=40, temperature=0,
                tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**args)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"] and whole.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")

    events, final = _streamed(client.responses.stream(**args))
    pieces = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == pieces and json.loads(pieces) == json.loads(calls[0].arguments)
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert added[-1].type == "function_call" and added[-1].name == "get_weather"
    assert [item.type for item in final.output if item.type == "function_call"] == ["function_call"]

    required = client.responses.create(**{**args, "tool_choice": "required"})
    assert [item.name for item in required.output if item.type == "function_call"] == ["get_weather"]

    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 degrees."}
    answer = client.responses.create(model=MODEL, input=ask + whole.output + [result], tools=[WEATHER_TOOL],
                                     tool_choice="none", max_output_tokens=24, temperature=0)
    assert answer.output_text.strip() and not [item for item in answer.output if item.type == "function_call"]
    assert answer.tool_choice == "none"


def test_allowed_tools_limit_the_calls_to_the_functions_named(served_with_tools):
    """`tool_choice: {"type": "allowed_tools", ...}`, the Responses API's form: asked about the weather with only
    get_time allowed, `required` calls get_time; the response says which choice it served."""
    client = _client(served_with_tools)
    time_tool = {"type": "function", "name": "get_time", "description": "The local time in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                "required": ["city"], "additionalProperties": False}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    answer = client.responses.create(model=MODEL, input="What is the weather in Paris?", max_output_tokens=60,
                                     tools=[WEATHER_TOOL, time_tool], tool_choice=choice, temperature=0,
                                     parallel_tool_calls=False)
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_time"] and answer.status == "completed", answer.output
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert answer.tool_choice.type == "allowed_tools" and answer.tool_choice.tools == choice["tools"]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": [{"type": 5, "content": "hi"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({"input": [{"type": "function_call_output", "call_id": "", "output": "5"}]}, "input.0.call_id"),
    # An output whose call is not in the input (none, another, or after it): OpenAI's 400 too.
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c1", "output": "5"}]},
     "input.1.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c2", "output": "5"}]}, "input.1.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "5"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]},
     "input.0.call_id"),
    # The format's own fields, where the request has them (not under pydantic's branch name, json_schema).
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}},
     "text.format.strict"),
    ({"input": "hi", "text": {"format": {"type": "json_object", "extra": 1}}}, "text.format.extra"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]}]}, "input"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "context_management": [{"type": "compaction"}]}, "context_management"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),  # the model's template reads none
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"input": "hi", "include": ["web_search_call.results"]}, "include.0"),
    ({"input": "hi", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": -1}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": "5"}, "top_logprobs"),
    ({"input": "hi", "top_logprobs": 2.5}, "top_logprobs"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": {"role": "user", "content": "hi"}}, "input"),
    # Refused on the chat path, named as this request names them.
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "many words " * 6000}, "input"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "nope"}]}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "mcp", "server_label": "deepwiki"}]}}, "tool_choice.tools.0.type"),
])
def test_refused_with_the_field_named(served, body, param):
    response = httpx.post(served.base_url + "/responses", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Traceback" not in error["message"] and "response_format" not in error["message"]
    assert ".json_schema." not in error["message"]


LOGPROBS = ["message.output_text.logprobs"]


def _joined_bytes(logprobs) -> bytes:
    """The tokens' own bytes, one after another: a reply's UTF-8, fragments of a character included."""
    return b"".join(bytes(entry.bytes) for entry in logprobs)


def test_logprobs_whole_and_streamed(served):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: every token of the answer's text in its
    `output_text` part, as the same chat completion gives them; streamed, each delta carries its own tokens' (a
    character split over tokens comes out whole, with all of them), and the part at the end all of them."""
    client = _client(served)
    # Cut off, so that every token is text (no end-of-turn token); emoji take several tokens each.
    turn = [{"role": "user", "content": "Reply with three emoji faces and nothing else."}]
    args = dict(model=MODEL, input=turn, max_output_tokens=12, temperature=0, include=LOGPROBS, top_logprobs=3)
    whole = client.responses.create(**args)
    assert whole.status == "incomplete" and whole.top_logprobs == 3
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens == 12
    assert _joined_bytes(part.logprobs) == part.text.encode() and len(part.text) < 12  # characters over tokens
    for entry in part.logprobs:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(tops[0])  # greedy
    chat = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0, logprobs=True,
                                          top_logprobs=3)
    chat_entries = chat.choices[0].logprobs.content
    assert [entry.token for entry in part.logprobs] == [entry.token for entry in chat_entries]
    assert [entry.logprob for entry in part.logprobs] == pytest.approx([entry.logprob for entry in chat_entries],
                                                                       abs=1e-3)

    events = list(client.responses.create(stream=True, **args))
    text, data = "", b""
    for event in events:
        if event.type == "response.output_text.delta":
            text, data = text + event.delta, data + _joined_bytes(event.logprobs)
            assert data.startswith(text.encode()) and data.decode(errors="ignore") == text, (text, data)
    final = events[-1].response.output[0].content[0]
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert text == final.text == part.text and _joined_bytes(final.logprobs) == part.text.encode()
    assert [entry.token for entry in done.logprobs] == [entry.token for entry in final.logprobs] == [
        entry.token for entry in part.logprobs]


def test_logprobs_asked_either_way_and_not_at_all(served):
    """Top logprobs come with the logprobs they rank, included or not; the logprobs alone have no top ones; and
    a response that asks for neither has none (`logprobs: []`, as before)."""
    client = _client(served)
    args = dict(model=MODEL, input="Count from one to ten.", max_output_tokens=4, temperature=0)
    tops_only = client.responses.create(top_logprobs=2, **args).output[0].content[0].logprobs
    assert len(tops_only) == 4 and all(len(entry.top_logprobs) == 2 for entry in tops_only)
    included = client.responses.create(include=LOGPROBS, **args).output[0].content[0].logprobs
    assert len(included) == 4 and all(entry.top_logprobs == [] for entry in included)
    assert [entry.token for entry in included] == [entry.token for entry in tops_only]
    neither = client.responses.create(top_logprobs=0, **args)
    assert neither.output[0].content[0].logprobs == [] and neither.top_logprobs == 0
    streamed = list(client.responses.create(stream=True, **args))
    assert all(event.logprobs == [] for event in streamed if event.type == "response.output_text.delta")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0)


def test_structured_output_through_the_clients_parse_helper(served):
    """`responses.parse(text_format=...)`, as an application writes it: the client sends the model's strict JSON
    schema as `text.format` and reads the answer back into the model, whole and streamed."""
    client = _client(served)
    args = dict(model=MODEL, input="Describe a person as JSON with a name and an age.", text_format=Person,
                max_output_tokens=40, temperature=0)
    whole = client.responses.parse(**args)
    assert whole.status == "completed" and isinstance(whole.output_parsed, Person)
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "Person"
    with client.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == whole.output_parsed


def test_nothing_is_stored(served):
    client = _client(served)
    with pytest.raises(openai.BadRequestError, match="nothing is stored"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    created = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    assert httpx.post(served.base_url + "/responses", content=b"{not json", timeout=60).status_code == 400
    unknown = httpx.post(served.base_url + "/responses", json={"model": "gpt-4o", "input": "hi"}, timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


# ChatML, as the model's own template, plus a system line for a reasoning effort, as gpt-oss's template reads one.
EFFORT_TEMPLATE = """{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' and reasoning_effort is defined -%}
{{- '<|im_start|>system\nReasoning: ' + reasoning_effort + '<|im_end|>\n' -}}
{%- endif -%}
{{- '<|im_start|>' + message['role'] + '\n' + (message.content or '') + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


@pytest.fixture(scope="module")
def reasoning_served(tmp_path_factory):
    """The embedded model under --reasoning-parser deepseek_r1: every output starts in the reasoning, and this
    model never closes it, so each answer has a reasoning item; its chat template reads a reasoning effort. A
    whole response holds at most 2,000 logprob entries."""
    template = tmp_path_factory.mktemp("template") / "effort.jinja"
    template.write_text(EFFORT_TEMPLATE)
    with Supervise("--api-server-count", "1", "--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
                   "--kv-cache-memory", str(128 * 2**20), "--max-logprob-entries", "2000") as server:
        yield server


def test_reasoning_item_whole_and_streamed(reasoning_served):
    """The reasoning a chat completion gives as `reasoning_content` is the response's reasoning item, whole and
    as `response.reasoning_text` events; its tokens are counted apart in the usage."""
    client = _client(reasoning_served)
    turn = [{"role": "user", "content": "Is 17 a prime number?"}]
    chat = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0)
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    assert thought
    whole = client.responses.create(model=MODEL, input=turn, max_output_tokens=12, temperature=0)
    reasoning = [item for item in whole.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and whole.output[0] is reasoning[0] and reasoning[0].id.startswith("rs_")
    assert [part.text for part in reasoning[0].content] == [thought] and reasoning[0].summary == []
    assert whole.output_text == (chat.choices[0].message.content or "")
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    usage = whole.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens <= usage.output_tokens

    events = list(client.responses.create(model=MODEL, input=turn, max_output_tokens=12, temperature=0, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert added[0].type == "reasoning" and added[0].status == "in_progress"
    item_id = added[0].id
    deltas = [event for event in events if event.type == "response.reasoning_text.delta"]
    assert deltas and {event.item_id for event in deltas} == {item_id}
    done = [event for event in events if event.type == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0].text == "".join(event.delta for event in deltas) == thought
    parts = [event.type for event in events if event.type.startswith("response.content_part.")
             and event.item_id == item_id]
    assert parts == ["response.content_part.added", "response.content_part.done"]
    final = events[-1].response
    assert final.status == whole.status and final.usage.output_tokens_details == usage.output_tokens_details
    assert [item.model_dump(exclude={"id"}) for item in final.output] == [
        item.model_dump(exclude={"id"}) for item in whole.output]

    # Passed back as it came, the reasoning item is accepted with the rest of the conversation.
    history = turn + whole.output + [{"role": "user", "content": "And 18?"}]
    assert client.responses.create(model=MODEL, input=history, max_output_tokens=4).output[0].type == "reasoning"


def test_a_reasoning_effort_reaches_a_template_that_reads_one(reasoning_served, served):
    """`reasoning.effort` (and a chat request's `reasoning_effort`) is the chat template's variable of that name, as
    Codex and the Agents SDK send it with `summary: "auto"` and the encrypted reasoning included; refused where the
    template reads none (the model's own, in `served`)."""
    client = _client(reasoning_served)
    turn = [{"role": "user", "content": "Is 17 a prime number?"}]
    plain = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1)
    chat = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1, reasoning_effort="high")
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens  # the template's "Reasoning: high" line
    answer = client.responses.create(model=MODEL, input=turn, max_output_tokens=4,
                                     reasoning={"effort": "high", "summary": "auto"},
                                     include=["reasoning.encrypted_content"])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.reasoning.effort == "high" and answer.reasoning.summary == "auto"
    assert answer.output[0].type == "reasoning" and answer.output[0].encrypted_content is None
    assert answer.output[0].content[0].text  # the reasoning itself, as text, for the next turn

    with pytest.raises(openai.BadRequestError) as conflict:
        client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1, reasoning_effort="high",
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert conflict.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as unread:
        _client(served).chat.completions.create(model=MODEL, messages=turn, max_tokens=1, reasoning_effort="low")
    assert unread.value.body["param"] == "reasoning_effort" and "reads no reasoning effort" in unread.value.message
    # Careless values: one outside the set, and the field on completions, which have no chat template to take it.
    for path, body in (("/chat/completions", {"messages": turn, "reasoning_effort": "max"}),
                       ("/chat/completions", {"messages": turn, "reasoning_effort": 3}),
                       ("/completions", {"prompt": "Hi", "reasoning_effort": "high"})):
        refused = httpx.post(reasoning_served.base_url + path, json={"model": MODEL, "max_tokens": 1, **body},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort", refused.text


def test_logprobs_refused_where_they_cannot_be_given(reasoning_served):
    """Past --max-logprob-entries a 400 before anything runs, streamed too (the last event holds the whole
    response); and where a reasoning parser splits the output, which tokens were the answer's text is not known:
    a 400 naming the field, pointing to chat completions. Nothing was started: the next request is served."""
    for stream in (False, True):
        too_many = httpx.post(reasoning_served.base_url + "/responses", json={
            "model": MODEL, "input": "hi", "max_output_tokens": 1000, "top_logprobs": 5, "stream": stream},
            timeout=60)
        assert too_many.status_code == 400, too_many.text
        error = too_many.json()["error"]
        assert error["param"] == "top_logprobs" and "6,000 logprob entries" in error["message"], error
        assert "max_output_tokens" in error["message"] and "Stream it" not in error["message"]
    for body, param in (({"include": LOGPROBS}, "include"), ({"top_logprobs": 2}, "top_logprobs")):
        split = httpx.post(reasoning_served.base_url + "/responses",
                           json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **body}, timeout=60)
        assert split.status_code == 400 and split.json()["error"]["param"] == param, split.text
        assert "--reasoning-parser" in split.json()["error"]["message"]
    assert _client(reasoning_served).responses.create(model=MODEL, input="hi", max_output_tokens=2).output
