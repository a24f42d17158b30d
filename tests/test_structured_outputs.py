"""Structured outputs end to end with the embedded model (the session's shared group) and the `openai` client:
each kind of constraint on chat and completions, streamed and not, every output parsed by the constraint's own
validator; bad constraints refused with a 400 that names the problem."""
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from apiserver.structured_outputs import INLINE_SCHEMA_BYTES
from tests.hostile_grammars import ref_chain, rule_chain

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CITIES = ["Paris", "London", "Berlin", "Madrid"]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _streamed_chat(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_chat_json_schema_whole_and_streamed(client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    args = dict(model=model, messages=ASK_PERSON, max_tokens=40, response_format=response_format)
    reply = client.chat.completions.create(temperature=0, **args)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert reply.choices[0].finish_reason == "stop"
    text, finish = _streamed_chat(client.chat.completions.create(temperature=1.0, seed=5, stream=True, **args))
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"


def test_parse_of_a_pydantic_model_with_a_set(client, model):
    """The openai package's `parse()` sends the model's schema, and pydantic writes `uniqueItems` for a set, which
    llguidance does not enforce: left out of the constraint (as vLLM does) rather than a 400 "Unimplemented keys";
    the answer parses into the model. Whatever else is wrong with a schema is still a 400 (the test below)."""
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        hobbies: set[Literal["chess", "golf", "music"]] = pydantic.Field(max_length=2)

    reply = client.chat.completions.parse(model=model, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                          response_format=Person)
    assert isinstance(reply.choices[0].message.parsed, Person), reply


def _large(schema: dict) -> dict:
    """`schema`, past INLINE_SCHEMA_BYTES of JSON by a description: built by a grammar checker, not inline."""
    return {**schema, "description": "x" * (INLINE_SCHEMA_BYTES + 1)}


def test_a_schema_built_by_a_checker_holds_and_a_bad_one_is_the_same_400(client, model):
    """A schema of 64 KB or more is built in a checker's process, not inline (how long the event loop is held is
    bench/large_schema.py's): its output holds to it, for a response_format and a forced tool call alike, and a
    bad one is refused with the same 400 as a small one."""
    reply = client.chat.completions.create(
        model=model, messages=ASK_PERSON, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": _large(PERSON)}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    tool = {"type": "function", "function": {"name": "person", "parameters": _large(PERSON)}}
    reply = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=40, temperature=0,
                                           tools=[tool], tool_choice="required")
    jsonschema.validate(json.loads(reply.choices[0].message.tool_calls[0].function.arguments), PERSON)
    for fields, param in (({"response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": _large({"type": "bogus"})}}}, "response_format"),
                          ({"tools": [{**tool, "function": {"name": "f", "parameters": _large({"type": "bogus"})}}],
                            "tool_choice": "required"}, "tools")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, extra_body=fields)
        assert caught.value.body["param"] == param and "bogus" in caught.value.body["message"]


def test_n_choices_with_a_seed_each_valid_and_reproducible(client, model):
    args = dict(model=model, messages=ASK_PERSON, max_tokens=30, n=2, temperature=0.7, seed=42,
                extra_body={"structured_outputs": {"json": PERSON}})
    first = client.chat.completions.create(**args)
    for choice in first.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    again = client.chat.completions.create(**args)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_json_object_and_completions_regex(client, model):
    obj = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    args = dict(model=model, prompt="The date of the next full moon is", max_tokens=12,
                extra_body={"structured_outputs": {"regex": DATE}})
    whole = client.completions.create(temperature=0, **args)
    assert re.fullmatch(DATE, whole.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(temperature=0.8, seed=3, stream=True, **args)
                       if c.choices)
    assert re.fullmatch(DATE, streamed)


def test_choice_and_grammar(client, model):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": CITIES}})
    assert reply.choices[0].message.content in CITIES
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/'
    text, _ = _streamed_chat(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "How many legs do three spiders have?"}], max_tokens=12,
        temperature=0, stream=True, extra_body={"structured_outputs": {"grammar": lark}}))
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", text)
    gbnf = 'root ::= "yes" | "no"'
    done = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": gbnf}})
    assert done.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("constraint, answer", [({"regex": ""}, ""), ({"choice": [""]}, ""), ({"regex": "ab"}, "ab")])
def test_min_tokens_yields_to_a_grammar_that_must_end(client, model, constraint, answer):
    """The grammar's output is complete (at once, or after two letters): the answer ends there, min_tokens or
    not, streamed or not. Before, a grammar that allowed only the end at once with min_tokens barring it left
    no token possible: the engine drew one the grammar refused, and the request failed with a grammar error."""
    question = [{"role": "user", "content": "Say something."}]
    for stream in (False, True):
        args = dict(model=model, messages=question, max_tokens=6, temperature=1.0, seed=3, stream=stream,
                    extra_body={"structured_outputs": constraint, "min_tokens": 4})
        if stream:
            text, finish = _streamed_chat(client.chat.completions.create(**args))
        else:
            reply = client.chat.completions.create(**args)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (text, finish) == (answer, "stop"), (constraint, stream)


def test_logprobs_are_of_the_masked_distribution(client, model):
    question = [{"role": "user", "content": "Name a city."}]
    reply = client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=4, extra_body={"structured_outputs": {"choice": CITIES}})
    first = reply.choices[0].logprobs.content[0]
    possible = [t.token for t in first.top_logprobs if t.logprob > -9999]
    assert possible and all(any(city.startswith(token) for city in CITIES) for token in possible)


def test_stop_string_still_cuts_a_constrained_output(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ASK_PERSON, max_tokens=40, temperature=0, stop=['"age"'],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert '"age"' not in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}},
     "response_format", "thing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format", "minimum"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "missing_rule"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "empty"),
    ({"structured_outputs": {"choice": [str(i) for i in range(10_001)]}}, "structured_outputs.choice",
     "--max-structured-output-choices"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "no output at all"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice",
     "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
])
def test_bad_constraints_are_400_naming_the_problem(client, model, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, extra_body=fields)
    error = caught.value.body
    assert error["param"].startswith(param) and "Traceback" not in error["message"]
    if words:
        assert words in error["message"]


def _grammar_400(error: dict, param: str, words: str) -> None:
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["code"] == "invalid_structured_output" and words in error["message"]
    assert len(error["message"]) < 400 and "<state>" not in error["message"] and "<grammar>" not in error["message"]


@pytest.mark.parametrize("pattern", ["b{888888}", "a{999999}"])
def test_a_regex_past_the_lexer_limits_is_a_400_every_time(client, model, pattern):
    """It compiles (llguidance builds its lexer lazily) and fails at its first token: the API server's check
    takes that step too, so every such request is a 400, streamed or not, and nothing is queued."""
    for stream in (False, True, False):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=5, stream=stream,
                                           extra_body={"structured_outputs": {"regex": pattern}})
        _grammar_400(caught.value.body, "structured_outputs", "too many expressions")
    reply = client.completions.create(model=model, prompt="The date of the next full moon is", max_tokens=12,
                                      temperature=0, extra_body={"structured_outputs": {"regex": DATE}})
    assert re.fullmatch(DATE, reply.choices[0].text)  # the group serves on


def test_a_grammar_that_fails_in_the_engine_is_a_400_every_time(served, model):
    """A grammar that names a special token cannot be tried over the API server's byte vocabulary, so only the
    engine finds that this one fails (the regex before the token is past the lexer's limits): still a 400 with a
    short reason, each time (the failed matcher is not cached); streamed, the error event says the same."""
    lark = 'start: /b{888888}/ <|im_end|>'
    body = {"model": model, "messages": ASK_PERSON, "max_tokens": 5, "structured_outputs": {"grammar": lark}}
    with httpx.Client(base_url=served.base_url, timeout=120) as http:
        for _ in range(2):
            response = http.post("/chat/completions", json=body)
            assert response.status_code == 400, response.text
            _grammar_400(response.json()["error"], "structured_outputs", "too many expressions")
        with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    _grammar_400(json.loads(events[-2][len("data: "):])["error"], "structured_outputs", "too many expressions")


def test_thousands_of_choices_answer_one_of_them(client, model):
    labels = [f"label-{i:04d}" for i in range(2500)]
    question = [{"role": "user", "content": "Pick a label."}]
    args = dict(model=model, messages=question, max_tokens=16, extra_body={"structured_outputs": {"choice": labels}})
    reply = client.chat.completions.create(temperature=0, **args)
    assert reply.choices[0].message.content in labels and reply.choices[0].finish_reason == "stop"
    text, finish = _streamed_chat(client.chat.completions.create(temperature=1.0, seed=9, stream=True, **args))
    assert text in labels and finish == "stop"


def test_a_grammar_that_crashes_the_compiler_is_a_400_and_its_server_serves_on(served, client, model):
    """Each of these overflowed the stack of llguidance's compiler in the API server's event loop: the server died
    with every stream on it, and six in a minute took the group down. Checked in a process of their own, each is
    a 400 (the second time from the checker's verdicts, without crashing it again), and the same API servers
    serve on."""
    servers = {title: served.child_titled(title).pid for title in ("ApiServer_0", "ApiServer_1")}
    hostile = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1000)}}},
        {"structured_outputs": {"grammar": rule_chain(4000)}},
    ]
    for fields in hostile * 2:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, extra_body=fields)
        _grammar_400(caught.value.body, next(iter(fields)), "crashed the grammar compiler")
    assert {title: served.child_titled(title).pid for title in servers} == servers
    reply = client.completions.create(model=model, prompt="The date of the next full moon is", max_tokens=12,
                                      temperature=0, extra_body={"structured_outputs": {"regex": DATE}})
    assert re.fullmatch(DATE, reply.choices[0].text)


def test_a_schema_chained_100_deep_is_served(client, model):
    """Within what the checker's small stack allows (some 200 levels), with room to spare in the engine."""
    schema = ref_chain(100)
    reply = client.chat.completions.create(
        model=model, messages=ASK_PERSON, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")
