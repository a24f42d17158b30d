"""Soak: does any process of the group grow with the number of requests served? A benchmark, not a test.

    .venv/bin/python bench/soak.py                        # sim:1, 5,000 requests, 8 clients
    .venv/bin/python bench/soak.py --model "" --requests 1500 --warm-up 500 --server-args "--kv-cache-memory 268435456"

Starts the real group on a free loopback port and sends it a varied stream of requests, as a hostile or careless
client would, every one unique where it can be: chat and completions, streamed and not, unique prompts, request ids,
long stop strings, JSON schemas, regexes and choice lists; clients that disconnect mid-stream and before the first
token; bad requests (malformed JSON, unknown fields and models, invalid regexes, unknown paths, garbage that is not
HTTP). Every --sample-every requests it reads each process's RSS (every API server, the engine, the supervisor) and
the size of the group's log. After --warm-up requests (caches filling up to their bounds), the least-squares slope
of each against the requests served is its growth per 1,000 requests, printed against the target (--target-mb,
1 MB per 1,000 requests). On the CPU an engine's RSS also grows until its whole KV cache has been written once (its
pages are committed when first written, and the prefix cache keeps freed blocks, so new prompts take fresh ones
first): by default a quarter of the memory, gigabytes, which a real model's warm-up would take long to reach, so
give it a small --kv-cache-memory in --server-args. Last, what the engines and the API servers still hold (no request, when nothing leaked:
the development route /server_info, so the group runs with SUPERVISE_DEV_MODE=1, and /metrics).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine_info import machine_info  # noqa: E402
from bench.process_usage import titled_children  # noqa: E402
from bench.supervise_launcher import start_supervise  # noqa: E402

MB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sim:1", help='"" for the embedded model')
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--warm-up", type=int, default=2000, help="requests before growth is measured")
    p.add_argument("--sample-every", type=int, default=250)
    p.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    p.add_argument("--api-servers", type=int, default=1)
    p.add_argument("--server-args", default="", help="more options for supervise, e.g. \"--kv-cache-memory N\"")
    p.add_argument("--target-mb", type=float, default=1.0, help="most RSS growth per 1,000 requests, after warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the samples and figures here")
    return p.parse_args()


# --- the requests: each kind takes (soak, i, rng) and returns what came back ------------------------------------
class Soak:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self.address = tuple(url.removeprefix("http://").rsplit(":", 1))
        self.http = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64))

    def chat_body(self, i: int, rng: random.Random, **extra) -> dict:
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randrange(5, 60)))
        return {"model": self.model, "messages": [{"role": "user", "content": f"Request {i}: {words}"}],
                "max_tokens": rng.randrange(1, 8), **extra}

    def post(self, path: str, body, headers: dict | None = None) -> str:
        r = self.http.post(path, json=body, headers=headers)
        return str(r.status_code)

    def stream(self, path: str, body: dict, events: int | None = None, headers: dict | None = None) -> str:
        """Read the stream whole, or only its first `events` lines and then hang up."""
        with self.http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
            for n, _ in enumerate(r.iter_lines()):
                if events is not None and n >= events:
                    return f"{r.status_code} cut"
        return str(r.status_code)

    def raw(self, data: bytes, read: bool) -> str:
        with socket.create_connection((self.address[0], int(self.address[1])), timeout=30) as sock:
            sock.sendall(data)
            return sock.recv(64)[:12].decode(errors="replace") if read else "sent, gone"


def _chat(s: Soak, i, rng):
    return s.post("/v1/chat/completions", s.chat_body(i, rng), {"x-request-id": f"soak-{i}-{rng.random()}"})


def _chat_stream(s: Soak, i, rng):
    return s.stream("/v1/chat/completions", s.chat_body(i, rng, logprobs=True, top_logprobs=3, n=2))


def _completion_stops(s: Soak, i, rng):
    stops = [f"stop-{i}-{k}-" + "z" * rng.randrange(50, 400) for k in range(4)]
    body = {"model": s.model, "prompt": f"Count to {i}:", "max_tokens": 8, "stop": stops}
    return s.post("/v1/completions", body)


def _cut_mid_stream(s: Soak, i, rng):
    body = {"model": s.model, "prompt": f"Story {i}", "max_tokens": 200, "ignore_eos": True}
    return s.stream("/v1/completions", body, events=2)


def _gone_before_first_token(s: Soak, i, rng):
    body = json.dumps({**s.chat_body(i, rng), "max_tokens": 50, "stream": rng.random() < 0.5}).encode()
    return s.raw(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body), read=False)


def _schema(s: Soak, i, rng):
    props = {f"p{i}_{k}": {"type": rng.choice(["string", "integer", "boolean"])} for k in range(rng.randrange(1, 6))}
    schema = {"type": "object", "properties": props, "required": list(props)}
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
    return s.post("/v1/chat/completions", s.chat_body(i, rng, response_format=fmt))


def _regex_or_choice(s: Soak, i, rng):
    if rng.random() < 0.5:
        constraint = {"regex": f"(id{i})-[a-z]{{1,{rng.randrange(2, 9)}}}"}
    else:
        constraint = {"choice": [f"c{i}-{k}" for k in range(rng.randrange(2, 30))]}
    return s.post("/v1/completions", {"model": s.model, "prompt": "Pick:", "max_tokens": 6,
                                      "structured_outputs": constraint})


def _bad(s: Soak, i, rng):
    kind = rng.randrange(6)
    if kind == 0:
        return s.raw(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n{not json", True)
    if kind == 1:
        return s.post("/v1/chat/completions", {**s.chat_body(i, rng), f"field_{i}": 1})
    if kind == 2:
        return s.post("/v1/chat/completions", {**s.chat_body(i, rng), "model": f"no-such-model-{i}"})
    if kind == 3:
        return s.post("/v1/completions", {"model": s.model, "prompt": "x", "structured_outputs": {"regex": f"({i}"}})
    if kind == 4:
        return str(s.http.get(f"/no/such/path/{i}/{rng.random()}").status_code)
    return s.raw(b"\x16\x03\x01 this is not HTTP %d\r\n\r\n" % i, True)


def _tokenize(s: Soak, i, rng):
    return s.post("/tokenize", {"model": s.model, "prompt": f"unique text {i} {rng.random()} " * 20})


KINDS = [_chat, _chat_stream, _completion_stops, _cut_mid_stream, _gone_before_first_token, _schema,
         _regex_or_choice, _bad, _tokenize]


def send(s: Soak, i: int, seed: int) -> tuple[str, str]:
    rng = random.Random(seed * 1_000_003 + i)
    kind = KINDS[i % len(KINDS)]
    try:
        return kind.__name__, kind(s, i, rng)
    except (httpx.HTTPError, OSError) as exc:
        return kind.__name__, type(exc).__name__


# --- measuring ----------------------------------------------------------------------------------------------
def sample(server, served: int) -> dict:
    processes = {"supervisor": psutil.Process(server.pid), **titled_children(server.pid)}
    rss = {}
    for name, process in processes.items():
        try:
            rss[name] = process.memory_info().rss
        except Exception:  # noqa: BLE001  (gone: a replaced server shows up under its own name)
            pass
    return {"requests": served, "rss": rss, "log_bytes": os.path.getsize(server.log_file.name)}


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value against requests, per 1,000 requests."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return 1000 * sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def leftovers(s: Soak) -> str:
    """What the group still holds once every request is over (no request anywhere when nothing leaked), from the
    development route /server_info (SUPERVISE_DEV_MODE=1: the engines' own bookkeeping) and /metrics."""
    time.sleep(1.0)  # aborts of the last disconnects on their way
    info = s.http.get("/server_info").json()
    metrics = s.http.get("/metrics").text
    running = next(line.split()[-1] for line in metrics.splitlines() if line.startswith("supervise_num_requests_running"))
    held = [f"rank {e['rank']}: {e['num_requests']} requests ({e['num_running']} running, {e['num_waiting']} waiting;"
            f" {e['num_finished']} finished, {e['num_aborted']} aborted and {e['num_failed']} failed so far)"
            for e in info["engines"]]
    return f"{'; '.join(held)}; API servers' requests in flight: {running}"


def report(samples: list[dict], warm_up: int, target_mb: float) -> dict:
    measured = [x for x in samples if x["requests"] >= warm_up]
    first, last = samples[0], samples[-1]
    figures = {}
    print(f"\n{'process':<18}{'start MB':>10}{'warm MB':>10}{'end MB':>10}{'MB/1000 req':>13}  target <= {target_mb:g}")
    for name in last["rss"]:
        points = [(x["requests"], x["rss"][name] / MB) for x in measured if name in x["rss"]]
        growth = slope_per_1000(points) if len(points) >= 2 else float("nan")
        figures[name] = growth
        verdict = "ok" if growth <= target_mb else "OVER"
        print(f"{name:<18}{first['rss'].get(name, 0) / MB:>10.1f}{points[0][1]:>10.1f}{points[-1][1]:>10.1f}"
              f"{growth:>13.2f}  {verdict}")
    log_growth = slope_per_1000([(x["requests"], x["log_bytes"] / 1024) for x in measured])
    print(f"{'log':<18}{first['log_bytes'] / 1024:>9.0f}K{measured[0]['log_bytes'] / 1024:>9.0f}K"
          f"{last['log_bytes'] / 1024:>9.0f}K{log_growth:>12.1f}K")
    figures["log_kb"] = log_growth
    return figures


def main() -> None:
    args = parse_args()
    model_args = ["--model", args.model] if args.model else []
    os.environ["SUPERVISE_DEV_MODE"] = "1"  # /server_info: the engines' own count of the requests they hold
    model_args += shlex.split(args.server_args)
    server = start_supervise([*model_args, "--api-server-count", str(args.api_servers)])
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        soak = Soak(server.url, model)
        print(f"soak: {args.requests:,} requests to `supervise {' '.join(model_args)} --api-server-count "
              f"{args.api_servers}` ({model}), {args.clients} clients, RSS every {args.sample_every}")
        samples = [sample(server, 0)]
        outcomes: dict[str, int] = {}
        counter = itertools.count()
        started = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            while samples[-1]["requests"] < args.requests:
                batch = [next(counter) for _ in range(args.sample_every)]
                for kind, outcome in pool.map(lambda i: send(soak, i, args.seed), batch):
                    outcomes[f"{kind} {outcome}"] = outcomes.get(f"{kind} {outcome}", 0) + 1
                samples.append(sample(server, batch[-1] + 1))
        seconds = time.monotonic() - started
        print(f"{samples[-1]['requests']:,} requests in {seconds:.0f} s; outcomes:")
        for key in sorted(outcomes):
            print(f"  {key}: {outcomes[key]}")
        held = leftovers(soak)
        print(f"held afterwards: {held}")
        figures = report(samples, args.warm_up, args.target_mb)
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump({"args": vars(args), "machine": machine_info(), "samples": samples, "outcomes": outcomes,
                           "mb_per_1000": figures, "held": held, "seconds": seconds}, f, indent=1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
