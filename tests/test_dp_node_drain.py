"""A headless node stopped by its operator (`systemctl stop`: SIGTERM) drains: the head sends its rank no new
request, the ones it runs finish whole, then it leaves. A second SIGTERM cuts the drain short. Before, the node
left at once and every request on its rank failed with a 503 or an error event mid-stream."""
import json
import signal
import threading
import time
import uuid

import httpx
import psutil

from ipc.registration import NodeDraining
from tests.dp_support import SIM_MODEL, complete, deployment, dp_args, raw_node_message, wait_for  # noqa: F401
from tests.load import BackgroundLoad


class Stream(threading.Thread):
    """A completion streamed from rank 1, read to its end in the background: its events, and how it ended."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": SIM_MODEL, "prompt": "x", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                              headers={"X-data-parallel-rank": "1"}) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.started.set()

    def text(self) -> str:
        return "".join(c["text"] for e in self.events for c in e.get("choices", []))


def test_a_stopped_node_finishes_its_streams_and_takes_no_new_work(deployment):
    """With the default --on-engine-failure exit: a node stopped by its operator is no engine failure, the head
    serves on with its other ranks (it went down, failing every request on them), and takes the rank back when
    the node starts again (a node's upgrade without a failed request)."""
    head, node, rpc = deployment.head_and_node("--api-server-count", "2")
    stream = Stream(head.url, 300)  # 3 s at 10 ms a step
    stream.start()
    assert stream.started.wait(30) and not stream.error, stream.error
    with BackgroundLoad(head.url, SIM_MODEL, clients=2, max_tokens=5) as anywhere:
        anywhere.wait_for(4)
        node.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "rank 1 draining" in head.log(), 10, "the head to hear of the drain", head)
        time.sleep(0.3)  # the API servers take the mark with their next request
        pinned = complete(head.url, {"X-data-parallel-rank": "1"})
        assert pinned.status_code == 503, pinned.text
        assert "rank 1 takes no new requests" in pinned.json()["error"]["message"]
        ranks = {e["rank"]: e for e in httpx.get(f"{head.url}/load", timeout=5).json()["engines"]}
        assert ranks[1]["draining"] and ranks[1]["up"] and not ranks[0]["draining"]
        metrics = httpx.get(f"{head.url}/metrics", timeout=5).text
        assert f'supervise_engine_draining{{model_name="{SIM_MODEL}",engine="1"}} 1' in metrics
        assert f'supervise_engine_draining{{model_name="{SIM_MODEL}",engine="0"}} 0' in metrics
        assert httpx.get(f"{head.url}/health", timeout=5).status_code == 200  # rank 0 serves
        served = anywhere.ok
        wait_for(lambda: anywhere.ok >= served + 6, 30, "requests to go on on rank 0", head)
        stream.join(60)
        assert node.wait_exit(30) == 0
        wait_for(lambda: "rank 1 lost" in head.log(), 10, "the head to see the node leave", head)
        served = anywhere.ok
        wait_for(lambda: anywhere.ok >= served + 4, 30, "requests to go on after the node left", head)
    # The stream that ran on the node ended whole: every token, its finish reason, its usage.
    assert stream.done and not stream.error, (stream.error, stream.events[-2:])
    assert stream.events[-1]["usage"]["completion_tokens"] == 300, stream.events[-1]
    assert [c["finish_reason"] for e in stream.events for c in e.get("choices", []) if c["finish_reason"]] == ["length"]
    assert anywhere.failures == [], anywhere.failures  # no unpinned request was sent to the draining rank
    assert "the engines run nothing more" in node.log() and "its node left: stopped" in head.log()
    assert "its node was stopped: serving on ranks 0 until rank 1 registers again" in head.log()
    assert head.proc.poll() is None and "taking the group down" not in head.log()
    # The upgraded node starts again: rank 1 is back, pinned requests reach it.
    deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1"))
    wait_for(lambda: "rolling restart done" in head.log(), 30, "the head to take rank 1 back", head)
    assert complete(head.url, {"X-data-parallel-rank": "1"}).status_code == 200


def test_a_second_sigterm_cuts_the_drain_short(deployment):
    head, node, rpc = deployment.head_and_node("--on-engine-failure", "restart")
    # Anyone who can reach the registration port (no key here) and says DRAINING for a node it made up: no answer,
    # nothing drains.
    assert raw_node_message(rpc, NodeDraining(uuid.uuid4().hex, "x" * 1000), wait_ms=1000) is None
    assert not any(e["draining"] for e in httpx.get(f"{head.url}/load", timeout=5).json()["engines"])
    stream = Stream(head.url, 5000)  # 50 s
    stream.start()
    assert stream.started.wait(30)
    node.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "rank 1 draining" in head.log(), 10, "the head to hear of the drain", head)
    time.sleep(0.5)
    assert node.proc.poll() is None  # it waits for the stream
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait_exit(15) == 0
    stream.join(30)
    message = stream.events[-1].get("error", {}).get("message", "")
    assert "engine core DP1" in message and "node" in message and "network" not in message, stream.events[-1:]
    assert len(stream.text()) < 5000
    assert "a second stop signal: leaving now with 1 request(s) unfinished" in node.log()
    assert "its node left: stopped (a second signal cut the drain short)" in head.log()


def test_a_node_whose_head_is_gone_does_not_wait_for_requests_nobody_reads(deployment):
    """The head was SIGKILLed (every process of it) while a stream ran on the node: its engine decodes on for no
    reader. The node's drain waited for it until --shutdown-timeout (26 s in a sweep); it leaves once the head has
    not answered for --engine-ping-interval (1 s here)."""
    head, node, _ = deployment.head_and_node()
    stream = Stream(head.url, 5000)
    stream.start()
    assert stream.started.wait(30)
    for process in [psutil.Process(head.pid), *head.children()]:
        process.kill()
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait_exit(10) == 0
    assert "has not answered for" in node.log() and "leaving with 1 request(s) unfinished" in node.log()
