import pytest

from tests.supervise_process import Supervise


@pytest.fixture(scope="session")
def served():
    """The embedded model behind 2 API servers, shared by the tests that only talk to it."""
    with Supervise("--api-server-count", "2") as server:
        yield server


@pytest.fixture
def start_supervise():
    """start_supervise(*args) -> a serving Supervise; every group started is stopped after the test."""
    started: list[Supervise] = []

    def start(*args: str, env: dict | None = None, wait: bool = True) -> Supervise:
        server = Supervise(*args, env=env)
        started.append(server)
        return server.wait_serving() if wait else server

    yield start
    for server in started:
        server.stop()
