"""External balancing: real routers in front, requests through them complete and land where the router chose.

- vllm-router and smg across two groups started with `--data-parallel-rank 0` and `1` (one group per rank);
- vllm-router with `--intra-node-data-parallel-size 2` and smg with `--dp-aware` in front of one group with two
  ranks: they pin each request to a rank (vllm-router: the X-data-parallel-rank header; smg: the body's
  `data_parallel_rank`, once it read `dp_size` from /get_server_info, the worker registered as SGLang-type).
  A stream held open on rank 0 makes our own balancer send everything else to rank 1, so a pin that were
  ignored would show.

The routers live in their own venv, `.venv-gateway` (`make gateway`, which `make test` runs first).
"""
import contextlib
import os
import subprocess
import tempfile
import threading
import time

import httpx
import openai
import pytest

from tests.dp_support import SIM_MODEL, free_port, served_by_rank
from tests.supervise_process import Supervise, terminate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATEWAY_BIN = os.path.join(REPO, ".venv-gateway", "bin")
KEY = "router-key"

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(GATEWAY_BIN, tool)) for tool in ("smg", "vllm-router")),
    reason=f"smg and vllm-router are not installed in {GATEWAY_BIN}: `make gateway` installs them",
)


@pytest.fixture(scope="module")
def groups():
    """Two groups, ranks 0 and 1 of a deployment of 2, each on its own port (external balancing)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(Supervise("--model", SIM_MODEL, "--data-parallel-size", "2",
                                             "--data-parallel-rank", str(rank))) for rank in (0, 1)]


@pytest.fixture(scope="module")
def dp_group():
    """One group with two ranks behind an API key (vllm-router requires one in its DP-aware mode)."""
    with Supervise("--model", SIM_MODEL, "--data-parallel-size", "2", "--api-key", KEY) as group:
        yield group


@contextlib.contextmanager
def router(tool: str, *args: str, ready=None):
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{tool}-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [os.path.join(GATEWAY_BIN, tool), *(["launch"] if tool == "smg" else []), "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()), *args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not (ready or _models_listed)(url):
            assert process.poll() is None, open(log.name).read()[-3000:]
            assert time.monotonic() < deadline, f"{tool} not ready:\n{open(log.name).read()[-3000:]}"
            time.sleep(0.3)
        yield url
    finally:
        terminate(process, 15)
        log.close()


def _models_listed(url: str) -> bool:
    try:
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
        return r.status_code == 200 and SIM_MODEL in r.text
    except httpx.HTTPError:
        return False


def ask(url: str, times: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    for i in range(times):
        if i % 2:
            stream = client.chat.completions.create(model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        else:
            text = client.completions.create(model=SIM_MODEL, prompt="hi", max_tokens=5).choices[0].text
        assert text.startswith("Paris"), text


def by_rank(group) -> dict[int, int]:
    return served_by_rank(group.url)  # /metrics is open even behind an API key


@contextlib.contextmanager
def held_on_rank_zero(group):
    """A stream pinned to rank 0, held open: our own balancer would now send everything to rank 1."""
    release = threading.Event()
    started = threading.Event()

    def hold():
        body = {"model": SIM_MODEL, "prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        headers = {"X-data-parallel-rank": "0", "Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{group.url}/v1/completions", json=body,
                                                            headers=headers) as r:
            next(r.iter_lines())
            started.set()
            release.wait(120)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield
    finally:
        release.set()
        thread.join(30)


def test_each_external_group_serves_its_own_rank(groups):
    for rank, group in enumerate(groups):
        assert [e["rank"] for e in httpx.get(f"{group.url}/load", timeout=5).json()["engines"]] == [rank]
        info = httpx.get(f"{group.url}/get_server_info", timeout=5).json()
        assert info["data_parallel_size"] == 2 and info["data_parallel_ranks"] == [rank]
        ok = httpx.post(f"{group.url}/v1/completions", headers={"X-data-parallel-rank": str(rank)}, timeout=30,
                        json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2})
        other = httpx.post(f"{group.url}/v1/completions", headers={"X-data-parallel-rank": str(1 - rank)},
                           timeout=30, json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and other.status_code == 400, other.text
        assert "serve" in other.json()["error"]["message"]
    assert "(rank 1 of 2 (balanced by a router))" in groups[1].log()


@pytest.mark.parametrize("tool", ["vllm-router", "smg"])
def test_a_router_balances_across_two_groups(groups, tool):
    before = [by_rank(g) for g in groups]
    urls = [g.url for g in groups]
    with router(tool, "--worker-urls", *urls, "--policy", "round_robin") as url:
        ask(url, 6)
    after = [by_rank(g) for g in groups]
    assert [after[r][r] - before[r][r] for r in (0, 1)] == [3, 3]


def test_vllm_router_pins_each_request_to_the_rank_it_chose(dp_group):
    with held_on_rank_zero(dp_group):
        before = by_rank(dp_group)
        with router("vllm-router", "--worker-urls", dp_group.url, "--policy", "round_robin",
                    "--intra-node-data-parallel-size", "2", "--api-key", KEY) as url:
            ask(url, 6)
        after = by_rank(dp_group)
    assert {r: after[r] - before[r] for r in (0, 1)} == {0: 3, 1: 3}


def test_smg_dp_aware_pins_each_request_to_the_rank_it_chose(dp_group):
    auth = {"Authorization": f"Bearer {KEY}"}
    registered = []

    def ready(url: str) -> bool:
        """smg tells an HTTP worker's runtime from /v1/models (owned_by) and /version, and discovers ranks only
        of SGLang-type ones: the operator registers the group as one (smg's POST /workers, runtime_type)."""
        try:
            if not registered:
                r = httpx.post(f"{url}/workers", headers=auth, timeout=2,
                               json={"url": dp_group.url, "runtime_type": "sglang", "api_key": KEY})
                registered.append(r.status_code)
            workers = httpx.get(f"{url}/workers", headers=auth, timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return sorted(w.get("dp_rank") for w in workers if w.get("status") == "ready") == [0, 1]

    with held_on_rank_zero(dp_group):
        before = by_rank(dp_group)
        with router("smg", "--policy", "round_robin", "--dp-aware", "--api-key", KEY, ready=ready) as url:
            ask(url, 6)
        after = by_rank(dp_group)
    assert registered and registered[0] in (200, 202), registered
    assert {r: after[r] - before[r] for r in (0, 1)} == {0: 3, 1: 3}
