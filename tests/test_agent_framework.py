"""A real agent framework, unchanged, as the client: langchain-openai's ChatOpenAI against the embedded model with
the Hermes tool template (the session's tools group). Structured output as a pydantic object (both of
langchain's methods: json_schema and function_calling), and a tool-calling loop: a forced call, the tool run by
langchain, the answer after its result; streamed too."""
import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0)


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "clear"})


@pytest.fixture(scope="module")
def llm(served_with_tools):
    return ChatOpenAI(base_url=served_with_tools.base_url, api_key="unused", model="SmolLM2-135M-Instruct",
                      temperature=0, max_tokens=40, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    person = llm.with_structured_output(Person, method=method).invoke("Describe a person with a name and an age.")
    assert isinstance(person, Person)  # langchain parsed and validated it


def test_tool_calling_loop(llm):
    question = HumanMessage("What is the weather in Paris?")
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather"
    get_weather.args_schema.model_validate(call["args"])  # the arguments fit the tool's own schema
    result = get_weather.invoke(call)  # langchain runs the tool: a ToolMessage for this call id
    assert result.tool_call_id == call["id"]
    answer = llm.bind_tools([get_weather]).invoke([question, called, result])
    assert answer.content or answer.tool_calls
    for later in answer.tool_calls:
        get_weather.args_schema.model_validate(later["args"])


def test_streamed_tool_call(llm):
    chunks = list(llm.bind_tools([get_weather], tool_choice="any").stream("What is the weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert isinstance(merged, AIMessageChunk) and len(chunks) > 2  # it streamed in pieces
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather"
    get_weather.args_schema.model_validate(call["args"])
