"""Data parallelism on simulated engines: scaling with ranks, the cost of a remote rank, the balance.

Three measurements, each a closed loop of streamed chat completions (`--output-len` tokens, `ignore_eos`):
- scaling: one group with 1, 2 and 4 ranks (`--ranks`), engine-bound: each simulated engine runs at most
  `--max-num-seqs` sequences per step of `--step-ms` (the rest wait, as on a real engine), and the loop keeps
  twice as many streams in flight as the largest deployment can run, so throughput is what the engines can do.
  Prints requests/s and output tokens/s, and the speed-up over one rank (targets: >= 1.8x at 2, >= 3.4x at 4);
- balance: in the same runs, the requests each rank took (supervise_engine_requests_total): busiest/idlest
  (target <= 1.2);
- local against remote: a head with rank 0 and a headless node with rank 1 on 127.0.0.1, over TCP with the
  deployment's CURVE key; the same load pinned (X-data-parallel-rank) to rank 0, then to rank 1, alternately.
  Prints the CPU each streamed token costs the API servers plus the rank's engine (the kernel's accounting),
  and the tokens/s: the TCP + CURVE cost per token is the remote figure over the local one (target <= 1.10).

    .venv/bin/python bench/dp.py
    .venv/bin/python bench/dp.py --ranks 1 2 --duration 5 --result-json dp.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from closed_loop_clients import _keep_in_flight  # noqa: E402
from http_client import HttpClient  # noqa: E402
from machine_info import machine_info  # noqa: E402
from openai_request import request_body  # noqa: E402
from process_usage import cpu_seconds, cpu_spent, titled_children  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402

from tests.dp_support import Node, free_port  # noqa: E402  (supervise_launcher put the checkout on the path)

CHAT_PATH = "/v1/chat/completions"
TARGETS = {"scaling_2": 1.8, "scaling_4": 3.4, "balance": 1.2, "remote_cost": 1.10}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes to compare")
    p.add_argument("--step-ms", type=float, default=20.0, help="the simulated engines' step interval")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences one simulated engine runs per step")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each stream")
    p.add_argument("--api-server-count", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each measured phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each phase, not measured")
    p.add_argument("--remote-step-ms", type=float, default=2.0,
                   help="local against remote: a fast pace, so the IPC's share of the cost shows")
    p.add_argument("--remote-concurrency", type=int, default=16)
    p.add_argument("--remote-rounds", type=int, default=2, help="local/remote phases each, alternated")
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def closed_loop(url: str, body: bytes, concurrency: int, duration: float, headers: dict | None = None) -> dict:
    async def run() -> dict:
        client = HttpClient(url, headers)
        try:
            return await _keep_in_flight(client, CHAT_PATH, body, concurrency, duration, 1, 120.0)
        finally:
            client.close()

    return asyncio.run(run())


def requests_by_rank(url: str) -> dict[int, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'supervise_engine_requests_total\{.*engine="(\d+)"\} (\S+)', line)
        if match:
            counts[int(match.group(1))] = float(match.group(2))
    return counts


def scaling(args, ranks: int, concurrency: int, body: bytes) -> dict:
    server = start_supervise([
        "--model", f"sim:{args.step_ms:g}", "--data-parallel-size", str(ranks), "--max-num-seqs",
        str(args.max_num_seqs), "--api-server-count", str(args.api_server_count),
    ])
    try:
        closed_loop(server.url, body, concurrency, args.warmup)
        before = requests_by_rank(server.url)
        done = closed_loop(server.url, body, concurrency, args.duration)
        after = requests_by_rank(server.url)
    finally:
        server.stop()
    taken = [after[r] - before.get(r, 0) for r in sorted(after)]
    wall = done["wall_s"]
    return {
        "ranks": ranks, "requests_per_s": done.get("requests", 0) / wall, "tokens_per_s": done.get("tokens", 0) / wall,
        "errors": done["errors"], "requests_by_rank": taken,
        "busiest_over_idlest": max(taken) / min(taken) if min(taken) > 0 else float("inf"),
    }


def local_against_remote(args, body: bytes) -> dict:
    """rank 0 on the head (ipc://) against rank 1 on a headless node (tcp:// + CURVE), the same load pinned."""
    key = os.path.join(tempfile.mkdtemp(prefix="dp-bench-"), "dp.key")
    with open(key, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(key, 0o600)
    rpc = free_port()
    common = ["--model", f"sim:{args.remote_step_ms:g}", "--data-parallel-size", "2", "--data-parallel-rpc-port",
              str(rpc), "--data-parallel-key-file", key, "--max-num-seqs", "256"]
    node = Node(*common, "--data-parallel-start-rank", "1")
    head = None
    try:
        head = start_supervise([*common, "--data-parallel-size-local", "1", "--api-server-count",
                                str(args.api_server_count)])
        node.wait_registered()
        charged = {0: titled_children(head.pid), 1: {k: v for k, v in titled_children(head.pid).items()
                                                     if k.startswith("ApiServer")}}
        charged[1].update(titled_children(node.pid))
        charged[0] = {k: v for k, v in charged[0].items() if k.startswith("ApiServer") or k == "EngineCore_DP0"}
        totals = {0: {"tokens": 0, "cpu_s": 0.0, "wall_s": 0.0}, 1: {"tokens": 0, "cpu_s": 0.0, "wall_s": 0.0}}
        for _ in range(args.remote_rounds):
            for rank in (0, 1):
                headers = {"X-data-parallel-rank": str(rank)}
                closed_loop(head.url, body, args.remote_concurrency, args.warmup, headers)
                before = cpu_seconds(charged[rank])
                done = closed_loop(head.url, body, args.remote_concurrency, args.duration, headers)
                spent = cpu_spent(before, cpu_seconds(charged[rank]))
                totals[rank]["tokens"] += done.get("tokens", 0)
                totals[rank]["cpu_s"] += sum(spent.values())
                totals[rank]["wall_s"] += done["wall_s"]
    finally:
        if head is not None:
            head.stop()
        node.stop()
    result = {}
    for rank, name in ((0, "local"), (1, "remote")):
        t = totals[rank]
        result[name] = {"us_per_token": 1e6 * t["cpu_s"] / max(1, t["tokens"]), "tokens_per_s": t["tokens"] / t["wall_s"]}
    result["remote_over_local"] = result["remote"]["us_per_token"] / result["local"]["us_per_token"]
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    body = request_body(f"sim:{args.step_ms:g}", "Tell me about Paris.", args.output_len, chat=True, stream=True,
                        ignore_eos=True)
    concurrency = 2 * args.max_num_seqs * max(args.ranks)  # twice what the largest deployment runs at once
    print(f"scaling: sim:{args.step_ms:g}, --max-num-seqs {args.max_num_seqs}, {concurrency} streams of "
          f"{args.output_len} tokens in flight, {args.api_server_count} API servers, {args.duration:g} s per phase")
    runs = [scaling(args, ranks, concurrency, body) for ranks in args.ranks]
    base = runs[0]["tokens_per_s"] / runs[0]["ranks"]
    print(f"{'ranks':>5} {'req/s':>8} {'out tok/s':>10} {'speed-up':>9} {'requests per rank':>24} {'busiest/idlest':>15}")
    for run in runs:
        run["speed_up"] = run["tokens_per_s"] / base
        print(f"{run['ranks']:>5} {run['requests_per_s']:>8.1f} {run['tokens_per_s']:>10.0f} {run['speed_up']:>8.2f}x "
              f"{' '.join(f'{n:.0f}' for n in run['requests_by_rank']):>24} {run['busiest_over_idlest']:>15.2f}"
              + (f"  errors {run['errors']}" if run["errors"] else ""))

    remote_body = request_body(f"sim:{args.remote_step_ms:g}", "Tell me about Paris.", args.output_len, chat=True,
                               stream=True, ignore_eos=True)
    print(f"\nlocal against remote: sim:{args.remote_step_ms:g}, {args.remote_concurrency} streams pinned to one rank, "
          f"{args.remote_rounds} rounds each; CPU = API servers + the rank's engine")
    remote = local_against_remote(args, remote_body)
    for name in ("local", "remote"):
        r = remote[name]
        print(f"{name:>7}: {r['us_per_token']:7.1f} us CPU per token, {r['tokens_per_s']:8.0f} out tok/s")
    print(f"remote/local CPU per token: {remote['remote_over_local']:.3f} (target <= {TARGETS['remote_cost']})")

    by_ranks = {run["ranks"]: run for run in runs}
    verdicts = {
        "scaling_2": by_ranks.get(2, {}).get("speed_up"), "scaling_4": by_ranks.get(4, {}).get("speed_up"),
        "balance": max((run["busiest_over_idlest"] for run in runs if run["ranks"] > 1), default=None),
        "remote_cost": remote["remote_over_local"],
    }
    print("\ntargets: " + ", ".join(
        f"{k} {v:.2f} ({'met' if (v >= TARGETS[k] if k.startswith('scaling') else v <= TARGETS[k]) else 'NOT met'})"
        for k, v in verdicts.items() if v is not None))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "scaling": runs, "remote": remote,
                       "targets": TARGETS, "measured": verdicts, "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


if __name__ == "__main__":
    main()
