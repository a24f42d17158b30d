"""Every route besides the two generation endpoints, with the flags that turn them on or off."""
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.supervise_process import Supervise

MODEL = "sim:2"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def full():
    """One API server with every optional route on, in development mode."""
    with Supervise(
        "--model", MODEL, "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
        "--enable-prompt-tokens-details", env={"SUPERVISE_DEV_MODE": "1"},
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(full):
    with httpx.Client(base_url=full.url, timeout=30) as client:
        yield client


def test_models(http):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    assert card["root"] == MODEL  # the model's path, as given (vLLM's field)
    (permission,) = card["permission"]  # what clients reading vLLM's cards expect
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    assert permission["id"].startswith("modelperm-") and permission["organization"] == "*"


def test_one_model_by_its_name(full, http):
    """OpenAI's GET /v1/models/{model}, as the openai package's models.retrieve asks it: the served model's card,
    the list's own; any other name a 404 model_not_found."""
    client = openai.OpenAI(base_url=full.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    for other in ("gpt-4o", "org/some-model", MODEL + "x"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve(other)
        assert refused.value.body["code"] == "model_not_found" and other in refused.value.body["message"]
    spec = http.get("/openapi.json").json()
    assert spec["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"


def test_health_and_ping(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200


def test_version(http):
    assert re.match(r"\d+\.\d+", http.get("/version").json()["version"])


def test_invocations_picks_the_endpoint_by_shape(http):
    chat = http.post("/invocations", json={"model": MODEL, "messages": HELLO, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "Paris is"
    completion = http.post("/invocations", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == "Paris is"
    neither = http.post("/invocations", json={"model": MODEL, "input": "x"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]


def test_invocations_without_a_model_is_for_the_served_one(http):
    """SageMaker's payloads name no model (vLLM serves them with its own); another model is still a 404."""
    chat = http.post("/invocations", json={"messages": HELLO, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == MODEL
    completion = http.post("/invocations", json={"prompt": "x", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "Paris is"
    assert http.post("/invocations", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    plain = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # so do the OpenAI routes (vLLM's)
    assert plain.status_code == 200 and plain.json()["model"] == MODEL


def test_tokenize_and_detokenize(http):
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello, world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello, world"}
    chat = http.post("/tokenize", json={"model": MODEL, "messages": HELLO}).json()
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    assert http.post("/tokenize", json={"prompt": "no model named is fine"}).status_code == 200
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [10**7]}).status_code == 400


def test_tokenize_returns_token_strings_when_asked(http):
    """vLLM's `return_token_strs` was refused as an unknown field."""
    plain = http.post("/tokenize", json={"prompt": "Hello, world"}).json()
    assert plain["token_strs"] is None
    spelled = http.post("/tokenize", json={"prompt": "Hello, world", "return_token_strs": True}).json()
    assert spelled["tokens"] == plain["tokens"]
    assert spelled["token_strs"] == ["Hello", ",", "Ġworld"]  # byte-level BPE spells the space as Ġ
    chat = http.post("/tokenize", json={"messages": HELLO, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"] and "<|im_start|>" in chat["token_strs"]
    long_prompt = "word " * 20000  # past the worker thread's threshold
    long = http.post("/tokenize", json={"prompt": long_prompt, "return_token_strs": True}).json()
    assert "".join(long["token_strs"]).replace("Ġ", " ") == long_prompt
    bad = http.post("/tokenize", json={"prompt": "x", "return_token_strs": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_strs"


def test_tokenizer_info(http):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]


def test_the_api_server_holds_neither_torch_nor_transformers(http):
    """Its import graph is free of both by construction: transformers pulls torch in wherever torch is installed,
    and torch with CUDA made an idle API server hold 585 MB."""
    info = http.get("/server_info").json()["api_server"]
    packages = set(info["packages"])
    assert {"apiserver", "tokenizers", "jinja2"} <= packages  # the list is real: the server's own are there
    assert not {"torch", "transformers"} & packages
    with open(f"/proc/{info['pid']}/maps") as maps:
        assert not [line for line in maps if "libtorch" in line or "/torch/lib/" in line]


def test_prompt_tokens_details(http):
    usage = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def server_load(http) -> int:
    return http.get("/load").json()["server_load"]


def test_load_counts_requests_in_flight(http, full):
    assert server_load(http) == 0
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{full.base_url}/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        load = http.get("/load").json()
        assert load["server_load"] == 1
        (engine,) = load["engines"]  # the one rank, as this API server sees it
        assert engine["rank"] == 0 and engine["up"] and engine["in_flight_here"] == 1
    for _ in range(50):
        if server_load(http) == 0:
            break
    assert server_load(http) == 0


def test_openapi_and_offline_docs(http):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/invocations"):
        assert "post" in spec["paths"][path]
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
    page = http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "openapi.json" in page.text
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page.text)  # nothing fetched from elsewhere


def test_development_routes(http, full):
    info = http.get("/server_info").json()
    assert info["config"]["model"] == MODEL and info["engines"][0]["num_running"] == 0
    assert http.post("/reset_prefix_cache").status_code == 200
    assert "development routes" in full.log()


@pytest.fixture(scope="module")
def plain():
    """Two API servers, docs off, no optional routes, not in development mode."""
    with Supervise("--model", MODEL, "--api-server-count", "2", "--disable-docs") as server:
        yield server


def test_optional_routes_are_off_by_default(plain):
    for path in ("/openapi.json", "/docs", "/tokenizer_info", "/server_info"):
        response = httpx.get(plain.url + path, timeout=10)
        assert response.status_code == 404 and "error" in response.json()
    assert httpx.post(plain.url + "/reset_prefix_cache", timeout=10).status_code == 404
    assert httpx.get(plain.url + "/load", timeout=10).json()["server_load"] == 0


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def scrape(url: str) -> str:
    # A fresh connection each time, so the scrapes land on both API servers.
    with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        response = client.get(url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text


def test_metrics_are_group_totals_whichever_server_answers(plain):
    before = metric(scrape(plain.url), 'supervise_request_success_total{model_name="sim:2",finished_reason="length"}')
    for _ in range(12):
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            client.post(plain.base_url + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    scrapes = [scrape(plain.url) for _ in range(8)]
    finished = {metric(s, 'supervise_request_success_total{model_name="sim:2",finished_reason="length"}') for s in scrapes}
    assert finished == {before + 12}
    generated = {metric(s, "supervise_generation_tokens_total") for s in scrapes}
    assert len(generated) == 1 and generated.pop() >= 24
    assert all(metric(s, "supervise_api_servers ") == 2 for s in scrapes)
    assert all(metric(s, "supervise_e2e_request_latency_seconds_count") >= 12 for s in scrapes)
    assert all("# TYPE supervise_time_to_first_token_seconds histogram" in s for s in scrapes)
    # Cumulative buckets: never decreasing, +Inf is the count, and every request of 2 tokens on sim:2 took < 30 s.
    for name in ("supervise_e2e_request_latency_seconds", "supervise_time_to_first_token_seconds"):
        buckets = [float(line.rsplit(" ", 1)[1]) for line in scrapes[-1].splitlines()
                   if line.startswith(name + "_bucket")]
        assert len(buckets) == 15 and buckets == sorted(buckets)
        assert buckets[-1] == metric(scrapes[-1], name + "_count") == buckets[-4]  # le=30 holds them all


def test_metrics_with_vllm_names_read_by_a_prometheus_parser():
    """--metrics-names vllm: what reads vLLM's series (dashboards, the Gateway API Inference Extension's endpoint
    picker, autoscalers on the queue) finds them under vLLM's names, parsed by prometheus_client's own parser. With
    --max-num-seqs 2 and four long requests, the engine runs two and queues two: vllm:num_requests_running and
    vllm:num_requests_waiting say so for engine 0; after them the counters and histograms have them."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(url: str) -> dict:
        text = httpx.get(url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    with Supervise("--model", "sim:20", "--max-num-seqs", "2", "--metrics-names", "vllm") as server:
        labels = (("engine", "0"), ("model_name", "sim:20"))
        body = {"model": "sim:20", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(client.post, "/completions", json=body) for _ in range(4)]
            seen = set()
            while not all(a.done() for a in answers):
                now = samples(server.url)
                seen.add((now[("vllm:num_requests_running", labels)], now[("vllm:num_requests_waiting", labels)]))
                time.sleep(0.05)
            assert all(a.result().status_code == 200 for a in answers)
        assert (2, 2) in seen and max(running for running, _ in seen) == 2
        after = samples(server.url)
        model = (("model_name", "sim:20"),)
        assert after[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 4
        assert after[("vllm:generation_tokens_total", model)] == 240
        assert after[("vllm:e2e_request_latency_seconds_count", model)] == 4
        assert after[("vllm:time_to_first_token_seconds_count", model)] == 4
        assert 0 <= after[("vllm:kv_cache_usage_perc", labels)] <= 1
        assert after[("supervise_api_servers", ())] == 1  # ours where vLLM has none of the same meaning
        assert not any(name.startswith("supervise_request_success") for name, _ in after)
