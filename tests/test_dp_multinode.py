"""One endpoint over several nodes: a head with API servers and local ranks, a headless node with the others,
on 127.0.0.1 over TCP with the deployment's key. What an operator checks: it serves only once every rank is
there, requests spread over all ranks, a request can be pinned to one, every route shows every rank."""
import threading

import httpx
import openai
import psutil

from tests.dp_support import (SIM_MODEL, complete, deployment, dp_args, free_port, key_file,  # noqa: F401
                              served_by_rank, wait_for)


def test_a_head_and_a_headless_node_serve_as_one_endpoint(deployment, key_file):
    rpc = free_port()
    key = ["--data-parallel-key-file", key_file]
    head = deployment.head(*dp_args(4, rpc, "--data-parallel-size-local", "2", "--api-server-count", "2", *key),
                           wait=False, env={"SUPERVISE_DEV_MODE": "1"})
    wait_for(lambda: "waiting for rank(s) 2, 3 to register" in head.log(), 60, "the head to wait for ranks", head)
    assert "serving" not in head.log()  # no API server before every rank is there
    node = deployment.node(*dp_args(4, rpc, "--data-parallel-start-rank", "2", "--data-parallel-size-local", "2",
                                    *key))
    head.wait_serving()
    assert "unauthenticated" not in head.log() + node.log()

    engines = httpx.get(f"{head.url}/load", timeout=10).json()["engines"]
    assert [e["rank"] for e in engines] == [0, 1, 2, 3] and all(e["up"] and e["answering"] for e in engines)
    assert [e["address"].split(":")[0] for e in engines] == ["ipc", "ipc", "tcp", "tcp"]
    assert all(e["address"].startswith("tcp://127.0.0.1:") for e in engines[2:])

    # Eight at once through the openai client: all complete, and every rank took some.
    client = openai.OpenAI(base_url=head.base_url, api_key="unused")
    answers = []

    def ask():
        answers.append(client.chat.completions.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20).choices[0].message.content)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 8 and all(a.startswith("Paris") for a in answers)
    spread = served_by_rank(head.url)
    assert sorted(spread) == [0, 1, 2, 3] and sum(spread.values()) == 8 and min(spread.values()) >= 1, spread

    # Pinned: each rank takes exactly the request named for it, header or body.
    for rank in range(4):
        before = served_by_rank(head.url)
        assert complete(head.url, {"X-data-parallel-rank": str(rank)}).status_code == 200
        after = served_by_rank(head.url)
        assert {r: after[r] - before[r] for r in after} == {r: int(r == rank) for r in range(4)}
    before = served_by_rank(head.url)[3]
    assert complete(head.url, data_parallel_rank=3).status_code == 200
    assert served_by_rank(head.url)[3] == before + 1
    for bad in ("4", "one", "-1"):
        r = complete(head.url, {"X-data-parallel-rank": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-data-parallel-rank", r.text
    # A full-width digit is shown as the client wrote it (its UTF-8 bytes, which HTTP hands over as Latin-1).
    r = complete(head.url, {"X-data-parallel-rank": "１".encode()})
    assert r.status_code == 400 and "not '１'" in r.json()["error"]["message"], r.text
    # Two ranks named, by two headers or by the header and the body: refused rather than one picked.
    r = httpx.post(f"{head.url}/v1/completions", headers=[("X-data-parallel-rank", "1"), ("X-data-parallel-rank", "2")],
                   json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and "more than once" in r.json()["error"]["message"], r.text
    r = complete(head.url, {"X-data-parallel-rank": "1"}, data_parallel_rank=2)
    assert r.status_code == 400 and "name different ranks" in r.json()["error"]["message"], r.text
    before = served_by_rank(head.url)[2]  # the same rank twice is no conflict
    assert complete(head.url, {"X-data-parallel-rank": "2"}, data_parallel_rank=2).status_code == 200
    assert served_by_rank(head.url)[2] == before + 1

    metrics = httpx.get(f"{head.url}/metrics", timeout=10).text
    assert all(f'supervise_engine_up{{model_name="{SIM_MODEL}",engine="{r}"}} 1' in metrics for r in range(4))
    info = httpx.get(f"{head.url}/server_info", timeout=10).json()["engines"]
    # Each engine's own answer: the remote ones counted the requests they served.
    assert [e["rank"] for e in info] == [0, 1, 2, 3] and all("num_finished" in e for e in info)
    assert sum(e["num_finished"] for e in info) == sum(served_by_rank(head.url).values())


def test_held_streams_spread_evenly_over_local_and_remote_ranks(deployment):
    rpc = free_port()
    head = deployment.head(*dp_args(4, rpc, "--data-parallel-size-local", "2", "--api-server-count", "2"),
                           wait=False, env={"SUPERVISE_DEV_MODE": "1"})
    node = deployment.node(*dp_args(4, rpc, "--data-parallel-start-rank", "2"))
    head.wait_serving()
    # Without a key: warned once on each side, and every TCP port listens only on the address given.
    assert head.log().count(f"unauthenticated registration port tcp://127.0.0.1:{rpc}") == 1
    assert node.log().count("unauthenticated engine ports on 127.0.0.1") == 1
    for process in [psutil.Process(head.pid), *node.children()]:
        listening = [c.laddr for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert all(address.ip == "127.0.0.1" for address in listening), (process, listening)
    assert len(node.engine_pids()) == 2
    body = {"model": SIM_MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    release = threading.Event()

    def hold():
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{head.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            release.wait(60)

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        running = wait_for(lambda: _running_by_rank(head.url, 8), 30, "8 streams running", head)
        assert max(running) - min(running) <= 1, running  # busiest/idlest: 2/2, whatever the node
    finally:
        release.set()
        for t in threads:
            t.join(30)


def _running_by_rank(url: str, total: int) -> list[int] | None:
    """Each rank's running requests as its engine says (/server_info asks them), once they add up to `total`."""
    counts = [e["num_running"] for e in httpx.get(f"{url}/server_info", timeout=10).json()["engines"]]
    return counts if sum(counts) == total else None


def test_the_head_gives_up_on_a_rank_that_never_registers(deployment):
    head = deployment.head(*dp_args(2, free_port(), "--data-parallel-size-local", "1", "--engine-ready-timeout", "3"),
                           wait=False)
    assert head.wait_exit(60) == 1
    assert ("rank 1 (headless) not ready after 3 s (--engine-ready-timeout): start their nodes with "
            "`supervise --headless`") in head.log()
