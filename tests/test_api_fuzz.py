"""Fuzz the API from its own OpenAPI description with schemathesis, bounded in time: valid and invalid
requests for every operation; no answer may be a 5xx, and every 4xx must be an OpenAI error body.

The group runs the simulated engine with a short context, so that valid requests finish in milliseconds."""
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 (schemathesis brings hypothesis)

from tests.supervise_process import Supervise  # noqa: E402

MODEL = "sim:1"
EXAMPLES_PER_MODE = 40
SECONDS_PER_OPERATION = 12.0


@pytest.fixture(scope="module")
def fuzzed():
    with Supervise("--model", MODEL, "--max-model-len", "96", env={"SUPERVISE_DEV_MODE": "1"}) as server:
        yield server


@pytest.fixture(scope="module")
def operations(fuzzed):
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    return {f"{op.method.upper()} {op.path}": op for op in (result.ok() for result in schema.get_all_operations())}


def check_response(response, case) -> None:
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, response.text
        assert {"message", "type", "param", "code"} == set(body["error"]), response.text
        assert "Traceback" not in response.text


@pytest.mark.parametrize("name", [
    "POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize", "POST /invocations",
    "GET /v1/models", "GET /health", "GET /version", "GET /metrics",
])
def test_fuzz_operation(fuzzed, operations, name):
    operation = operations[name]
    started = time.monotonic()
    modes = [schemathesis.GenerationMode.POSITIVE]
    if operation.body:  # nothing to break in a GET without parameters
        modes.append(schemathesis.GenerationMode.NEGATIVE)
    for mode in modes:

        @settings(
            max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
        )
        @given(operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            if time.monotonic() - started > SECONDS_PER_OPERATION:
                return  # the time bound: the remaining examples pass without a request
            if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # else nearly every valid request stops at the 404 for its model
            check_response(case.call(base_url=fuzzed.url, timeout=30), case)

        fuzz()
