import os

import pytest

from tests import triton_setup  # noqa: F401  (first: it may choose Triton's interpreter, see there)

from tests.supervise_process import Supervise

HERMES_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates", "tool_chat_template_hermes.jinja")


@pytest.fixture(scope="session")
def served():
    """The embedded model behind 2 API servers, shared by the tests that only talk to it."""
    with Supervise("--api-server-count", "2") as server:
        yield server


@pytest.fixture(scope="session")
def served_with_tools():
    """The embedded model with the shipped Hermes tool template, auto tool choice and the qwen3 reasoning parser
    (the template opens <think> on request), for the tool-calling and agent-framework tests."""
    with Supervise("--chat-template", HERMES_TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--reasoning-parser", "qwen3", "--kv-cache-memory", str(256 * 2**20)) as server:
        yield server


@pytest.fixture
def start_supervise():
    """start_supervise(*args) -> a serving Supervise; every group started is stopped after the test."""
    started: list[Supervise] = []

    def start(*args: str, env: dict | None = None, wait: bool = True, prefix: list[str] = ()) -> Supervise:
        server = Supervise(*args, env=env, prefix=prefix)
        started.append(server)
        return server.wait_serving() if wait else server

    yield start
    for server in started:
        server.stop()
