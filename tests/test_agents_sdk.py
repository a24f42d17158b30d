"""The OpenAI Agents SDK, unchanged, as the client of POST /v1/responses (its default model speaks the Responses
API): an agent with a function tool against the embedded model with the Hermes tool template. The forced call's
arguments reach the Python function, its result goes back as a function_call_output, the agent answers; run
whole and streamed. Tracing is off: it would export to OpenAI."""
import asyncio
import json

import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def weather_agent(served_with_tools):
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return json.dumps({"city": city, "temperature": 21, "sky": "clear"})

    client = AsyncOpenAI(base_url=served_with_tools.base_url, api_key="unused", max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="Answer with the tool's help.", tools=[get_weather],
                  model=OpenAIResponsesModel(MODEL, client), reset_tool_choice=True,
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60))
    return agent, cities


def test_agent_calls_its_tool_and_answers(weather_agent):
    agent, cities = weather_agent
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                  "MessageOutputItem"]
    assert len(cities) == 1 and cities[0].strip()  # the SDK parsed the call's arguments and ran the function
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_agent_streamed(weather_agent):
    agent, cities = weather_agent
    raw: set[str] = set()
    named: list[str] = []

    async def run():
        streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=3)
        async for event in streamed.stream_events():
            if event.type == "raw_response_event":
                raw.add(event.data.type)
            elif event.type == "run_item_stream_event":
                named.append(event.name)
        return streamed

    streamed = asyncio.run(run())
    assert {"response.created", "response.function_call_arguments.delta", "response.output_text.delta",
            "response.completed"} <= raw
    assert named[:2] == ["tool_called", "tool_output"] and named[-1] == "message_output_created"
    assert len(cities) == 1 and streamed.final_output.strip()
