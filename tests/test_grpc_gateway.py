"""End to end: the real gateway (smg, the Shepherd Model Gateway) in front of `supervise --grpc` serving the
embedded model, and the `openai` client against the gateway's HTTP port.

The gateway lives in its own venv, `.venv-gateway` (`make gateway`, which `make test` runs first): it is a test
partner, never a dependency of ours.
"""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import jsonschema
import pytest
from openai import OpenAI
from smg_grpc_proto import vllm_engine_pb2 as pb
from tokenizers import Tokenizer

from tests.grpc_support import GrpcSupervise, generate_request
from tests.supervise_process import terminate, title_of, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATEWAY = os.path.join(REPO, ".venv-gateway", "bin", "smg")
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.skipif(
    not os.path.exists(GATEWAY), reason=f"the gateway is not installed at {GATEWAY}: `make gateway` installs it"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readiness(url: str) -> dict:
    try:
        return httpx.get(f"{url}/readiness", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


@pytest.fixture(scope="module")
def group():
    with GrpcSupervise("--api-server-count", "2") as server:
        yield server


@contextlib.contextmanager
def running_gateway(group, *options: str):
    """`smg launch` with our group as its one gRPC worker, the tokenizer from the model directory it reports."""
    model_dir = group.stub().GetModelInfo(pb.GetModelInfoRequest()).model_path
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="smg-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [GATEWAY, "launch", "--worker-urls", f"grpc://{group.target}", "--model-path", model_dir,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
         # its own Prometheus port too: the default (29000) would clash with any other gateway on the machine
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *options],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and readiness(url).get("healthy_workers") == 1, 60,
                   "the gateway to take our worker")
        yield url
    finally:
        terminate(proc, 20)
        log.close()


@pytest.fixture(scope="module")
def gateway(group):
    """The gateway with its default health checking (a probe a minute, three failures to mark a worker down):
    an engine step that keeps a ping waiting on this shared machine must not take the worker out."""
    with running_gateway(group) as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway):
    return OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


def engine_running(group) -> int:
    return group.stub().GetLoads(pb.GetLoadsRequest()).loads[0].num_running_reqs


def test_the_gateway_registers_our_worker_from_its_info_calls(gateway, group):
    (worker,) = httpx.get(f"{gateway}/workers", timeout=5).json()["workers"]
    assert worker["is_healthy"] and worker["connection_mode"] == "grpc" and worker["runtime_type"] == "vllm"
    assert worker["model_id"] == MODEL
    labels = worker["labels"]
    assert (labels["served_model_name"], labels["dp_size"], labels["page_size"], labels["vocab_size"]) == (
        MODEL, "1", "16", "49152")
    wait_for(lambda: "engine_load" in httpx.get(f"{gateway}/workers", timeout=5).json()["workers"][0], 30,
               "the gateway's first GetLoads poll")


def test_chat_whole_and_streamed_give_the_same_greedy_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert text and "Paris" in text
    assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_n_samples_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, n=2,
                                      temperature=1.0, seed=3)
    assert sorted(c.index for c in whole.choices) == [0, 1] and all(c.text for c in whole.choices)
    assert whole.usage.completion_tokens == 10 or all(c.finish_reason == "stop" for c in whole.choices)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, n=2,
                                           temperature=1.0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert all(texts.values()) and set(finishes) == {0, 1}


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_gateway(client):
    """The gateway sends the schema as the `json_schema` constraint (and json_object as `{"type":"object"}`)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           response_format=response_format)
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_choice_and_regex_constraints_over_grpc(group):
    model_dir = group.stub().GetModelInfo(pb.GetModelInfoRequest()).model_path
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompt = tokenizer.encode("The capital of France is").ids
    cities = ["Paris", "London", "Berlin"]
    (choice,) = group.stub().Generate(pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_tokens=10, temperature=0.0, choice=pb.ChoiceConstraint(choices=cities))))
    assert tokenizer.decode(list(choice.complete.output_ids)) in cities
    (date,) = group.stub().Generate(pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=tokenizer.encode("Today's date is").ids),
        sampling_params=pb.SamplingParams(max_tokens=12, temperature=0.0, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", tokenizer.decode(list(date.complete.output_ids)))


def test_a_client_that_goes_away_is_aborted_in_our_engine(gateway, group):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert engine_running(group) == 1
    started = time.monotonic()
    wait_for(lambda: engine_running(group) == 0, 10, "the abort to reach the engine")
    assert time.monotonic() - started < 10  # 2000 tokens would take minutes on this CPU


def test_the_gateway_follows_our_health_check(group):
    """A frozen engine misses its pings: HealthCheck says unhealthy (from the first miss, --engine-ping-interval
    5 s) and a gateway that probes every second stops routing to us; once it answers, the gateway comes back.
    The engine is thawed before its third miss would make the API servers exit."""
    engine = next(c for c in group.children() if title_of(c) == "supervise: EngineCore_DP0")
    with running_gateway(group, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                         "--health-success-threshold", "1") as gateway:
        engine.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: readiness(gateway).get("status") == "not ready", 20, "the gateway to see it down")
        finally:
            engine.send_signal(signal.SIGCONT)
        wait_for(lambda: readiness(gateway).get("healthy_workers") == 1, 60, "the gateway to see it back")
    (response,) = group.stub().Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                                                           sampling_params=pb.SamplingParams(max_tokens=2)))
    assert response.complete.finish_reason in ("length", "stop")


def test_a_logit_bias_over_grpc(group):
    """The proto's logit_bias map, straight to the worker (smg 1.13 does not fill it from an OpenAI request's
    `logit_bias`): +100 on " yes" makes it every token."""
    model_dir = group.stub().GetModelInfo(pb.GetModelInfoRequest()).model_path
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    (yes,) = tokenizer.encode(" yes", add_special_tokens=False).ids
    prompt = tokenizer.encode("The capital of France is").ids
    (plain,) = group.stub().Generate(generate_request(prompt, max_tokens=4, temperature=0.0))
    assert yes not in plain.complete.output_ids
    (biased,) = group.stub().Generate(generate_request(prompt, max_tokens=4, temperature=0.0, logit_bias={yes: 100.0}))
    assert list(biased.complete.output_ids) == [yes] * 4
