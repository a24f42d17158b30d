"""The front end alone: API servers, IPC and supervisor over the simulated engine, swept over --api-server-count.

For each count N, three closed-loop phases, the offered load growing with N (so much in flight per API server):
- requests: short non-streamed chat completions (max_tokens 1) on `sim:--sim-ms`: requests/s;
- streams: long streamed chat completions on the same fast engine, more tokens than the API servers can pass
  on: the most streamed tokens/s (a saturated server coalesces several tokens into one SSE event);
- paced: streams on a slow engine (`sim:--paced-sim-ms`, as a real model paces them), each token its own
  event: the CPU one streamed token costs in normal service.
It charges each phase with the CPU seconds the `supervise: ApiServer_*` processes spent in it (the kernel's
accounting, /proc/PID/stat), giving CPU per request and per streamed token, and reports each API server's
RSS and the scaling efficiency (throughput of N / N x throughput of one). The engine% and client% columns
say whether the simulated engine or the client ran out of CPU before the API servers did.

    .venv/bin/python bench/frontend.py                      # 1, 2, 4, 8 API servers, as many as there are cores
    .venv/bin/python bench/frontend.py --servers 1 8 --result-json f.json --plot f.png
    .venv/bin/python bench/frontend.py --servers 1 --vllm-url http://127.0.0.1:8100 --vllm-pid 12345
    .venv/bin/python bench/frontend.py --servers 1 --variant=--no-write-batching   # the same, side by side

`--vllm-url/--vllm-pid` runs the requests and paced phases against another server (its own engine paces the
streams) and charges the CPU of that one process (its API server), side by side.

`--grpc` adds gRPC API servers (`supervise --grpc`) to the same run, at each `--grpc-servers` count (default 1 and
8; the HTTP servers then default to one), with the same phases as Generate calls carrying the token ids the
HTTP server renders for the same chat (bench/grpc_clients.py): the cost of the gRPC front end against the HTTP
one, and of 8 gRPC servers against 1.

    .venv/bin/python bench/frontend.py --grpc
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from closed_loop_clients import ClosedLoopClients  # noqa: E402
from machine_info import machine_info  # noqa: E402
from openai_request import request_body  # noqa: E402
from process_usage import cpu_seconds, cpu_spent, rss_mb, titled_children, torch_loaded  # noqa: E402

TARGETS = {"us_per_request": 1000.0, "us_per_token": 40.0, "rss_mb": 200.0}
CHAT_PATH = "/v1/chat/completions"
PROMPT = "Tell me about Paris, the capital of France, in a few sentences."


def parse_args(argv=None) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, nargs="+", default=None,
                   help="API server counts to sweep (default: 1, 2, 4, 8 up to the core count; 1 with --grpc)")
    p.add_argument("--grpc", action="store_true", help="also measure gRPC API servers (supervise --grpc)")
    p.add_argument("--variant", action="append", default=[], metavar="ARGS",
                   help="also measure the HTTP servers started with these extra supervise options, right after "
                        "each count's default run (repeatable), e.g. --variant=--no-write-batching")
    p.add_argument("--grpc-servers", type=int, nargs="+", default=[1, 8],
                   help="gRPC API server counts to measure with --grpc (default: 1 8)")
    p.add_argument("--sim-ms", type=float, default=1.0, help="the simulated engine's step interval")
    p.add_argument("--engines", type=int, default=1 if cores < 8 else cores // 4,
                   help="simulated engine cores (--data-parallel-size): one process paces at most ~60k tokens/s "
                        "on this box, so many API servers need several (default: 1, or a quarter of 8+ cores)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each measured phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each phase, not measured")
    p.add_argument("--request-concurrency", type=int, default=32, help="requests in flight per API server")
    p.add_argument("--stream-concurrency", type=int, default=64, help="streams in flight per API server")
    p.add_argument("--stream-tokens", type=int, default=256, help="tokens of each stream")
    p.add_argument("--paced-sim-ms", type=float, default=20.0,
                   help="the step interval of the paced phase, slow enough that each token is its own event")
    p.add_argument("--paced-concurrency", type=int, default=32, help="paced streams in flight per API server")
    p.add_argument("--paced-tokens", type=int, default=64, help="tokens of each paced stream")
    p.add_argument("--client-processes", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)))
    p.add_argument("--vllm-url", default=None, help="another server to measure the same way (its root URL)")
    p.add_argument("--vllm-pid", type=int, default=None, help="the pid of that server's API process")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if bool(args.vllm_url) != bool(args.vllm_pid):
        p.error("--vllm-url and --vllm-pid go together")
    if args.servers is None:
        args.servers = [1] if args.grpc else [n for n in (1, 2, 4, 8) if n <= cores]
    return args


def phase_plan(model: str, args) -> dict[str, tuple[bytes, int]]:
    """Each phase's request body and the tokens each request yields."""
    stream = lambda tokens: request_body(model, PROMPT, tokens, chat=True, stream=True, ignore_eos=True)  # noqa: E731
    return {
        "requests": (request_body(model, PROMPT, 1, chat=True, stream=False, ignore_eos=False), 1),
        "streams": (stream(args.stream_tokens), args.stream_tokens),
        "paced": (stream(args.paced_tokens), args.paced_tokens),
    }


def grpc_clients_module():
    """bench/grpc_clients.py, imported for --grpc only: it needs smg-grpc-proto, which a machine that runs the
    HTTP figures alone (the GPU machine) may lack."""
    import grpc_clients

    return grpc_clients


def grpc_phase_plan(prompt: list[int], args) -> dict[str, tuple[bytes, int]]:
    """phase_plan's phases as Generate calls: the same prompt tokens, the same counts of output tokens."""
    generate_body = grpc_clients_module().generate_body
    return {
        "requests": (generate_body(prompt, 1, stream=False, ignore_eos=False), 1),
        "streams": (generate_body(prompt, args.stream_tokens, stream=True, ignore_eos=True), args.stream_tokens),
        "paced": (generate_body(prompt, args.paced_tokens, stream=True, ignore_eos=True), args.paced_tokens),
    }


def chat_prompt_ids(server) -> list[int]:
    """The token ids the HTTP server renders for phase_plan's chat (the model's chat template and tokenizer, from
    the directory the gRPC server reports), so both front ends are handed the same prompt."""
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from transformers import PreTrainedTokenizerFast

    model_dir = server.stub().GetModelInfo(pb.GetModelInfoRequest()).model_path
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_phase(clients: ClosedLoopClients, url: str, body: bytes, tokens: int, concurrency: int,
              api: dict[str, psutil.Process], others: dict[str, psutil.Process], args) -> dict:
    """One closed-loop phase; `api` are the processes charged, `others` are watched (engine, supervisor)."""
    path = grpc_clients_module().GENERATE_PATH if url.startswith("grpc://") else CHAT_PATH
    if args.warmup > 0:
        clients.run(url, path, body, concurrency, args.warmup, tokens)
    watched = {**api, **others}
    before, started = cpu_seconds(watched), time.perf_counter()
    done = clients.run(url, path, body, concurrency, args.duration, tokens)
    spent, wall = cpu_spent(before, cpu_seconds(watched)), time.perf_counter() - started
    api_cpu = sum(spent[k] for k in api)
    return {
        **done,
        "wall_s": wall,
        "concurrency": concurrency,
        "api_cpu_s": api_cpu,
        "api_cpu_share_each": api_cpu / wall / len(api),
        "other_cpu_share": {k: spent[k] / wall for k in others},
        "client_cpu_share": done["client_cpu_s"] / wall,
        "per_second": (done["tokens"] if tokens > 1 else done["requests"]) / wall,
        "api_cpu_us_per_unit": api_cpu / max(1, done["tokens"] if tokens > 1 else done["requests"]) * 1e6,
        "events_per_token": done["events"] / max(1, done["tokens"]),
    }


def row_from_phases(label: str, count: int, phases: dict, rss: dict[str, float], torch: dict[str, bool]) -> dict:
    get = lambda name, key: phases[name][key] if name in phases else None  # noqa: E731
    return {
        "label": label,
        "api_servers": count,
        "requests_per_s": get("requests", "per_second"),
        "api_cpu_us_per_request": get("requests", "api_cpu_us_per_unit"),
        "tokens_per_s": get("streams", "per_second"),
        "api_cpu_us_per_token_saturated": get("streams", "api_cpu_us_per_unit"),
        "events_per_token_saturated": get("streams", "events_per_token"),
        "api_cpu_us_per_token": get("paced", "api_cpu_us_per_unit"),
        "events_per_token": get("paced", "events_per_token"),
        "rss_mb_max": max(rss.values(), default=0.0),
        "rss_mb_mean": sum(rss.values()) / max(1, len(rss)),
        "rss_mb_by_server": rss,
        "torch_loaded": torch,  # by server: torch's library mapped in it
        "phases": phases,
    }


def measure_ours(clients: ClosedLoopClients, count: int, args, grpc: bool = False, variant: str = "") -> dict:
    """The saturating phases on a fast simulated engine, the paced one on a slow one: two group starts.
    `variant`: extra supervise options (shlex), named in the row's label."""
    from supervise_launcher import start_supervise

    phases, rss, torch = {}, {}, {}
    for sim_ms, names, per_server in ((args.sim_ms, ("requests", "streams"), None),
                                      (args.paced_sim_ms, ("paced",), args.paced_concurrency)):
        model = f"sim:{sim_ms:g}"
        # --max-num-seqs: the simulated engine runs at most that many sequences per step; here every stream at once.
        server = start_supervise(["--model", model, "--api-server-count", str(count),
                                  "--data-parallel-size", str(args.engines), "--max-num-seqs", "65536",
                                  *shlex.split(variant)],
                                 args.server_timeout, grpc=grpc)
        try:
            group = titled_children(server.pid)
            api = {k: v for k, v in group.items() if k.startswith("ApiServer_")}
            if len(api) != count:
                raise RuntimeError(f"expected {count} API servers, found {sorted(api)}")
            others = {**{k: v for k, v in group.items() if k not in api}, "supervisor": psutil.Process(server.pid)}
            plan = grpc_phase_plan(chat_prompt_ids(server), args) if grpc else phase_plan(model, args)
            for name in names:
                body, tokens = plan[name]
                concurrency = count * (per_server or (args.request_concurrency if name == "requests"
                                                      else args.stream_concurrency))
                phases[name] = run_phase(clients, server.url, body, tokens, concurrency, api, others, args)
                for k, v in rss_mb(api).items():
                    rss[k] = max(v, rss.get(k, 0.0))
            for k, v in torch_loaded(api).items():
                torch[k] = v or torch.get(k, False)
        finally:
            server.stop()
    label = f"supervise{' --grpc' if grpc else ''}{' ' + variant if variant else ''} x{count}"
    return row_from_phases(label, count, phases, rss, torch)


def measure_other(clients: ClosedLoopClients, args) -> dict:
    """The other server's own engine paces its streams: only the requests and paced phases apply."""
    import httpx

    model = httpx.get(f"{args.vllm_url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
    api = {"api": psutil.Process(args.vllm_pid)}
    others = {f"child_{c.pid}": c for c in api["api"].children(recursive=True)}
    plan = phase_plan(model, args)
    phases = {
        "requests": run_phase(clients, args.vllm_url, *plan["requests"], args.request_concurrency, api, others, args),
        "paced": run_phase(clients, args.vllm_url, *plan["paced"], args.paced_concurrency, api, others, args),
    }
    return row_from_phases(f"other ({args.vllm_url})", 1, phases, rss_mb(api), torch_loaded(api))


def add_efficiency(rows: list[dict]) -> None:
    """Against one server of the same front end (HTTP rows against HTTP x1, gRPC rows against gRPC x1)."""
    for row in rows:
        kind = row["label"].split(" x")[0]
        one = next((r for r in rows if r["api_servers"] == 1 and r["label"].split(" x")[0] == kind), None)
        for key, out in (("requests_per_s", "request_scaling"), ("tokens_per_s", "token_scaling")):
            ok = one and one[key] and row[key] is not None and row["label"].startswith("supervise")
            row[out] = row[key] / (row["api_servers"] * one[key]) if ok else None


def _cell(value, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


COLUMNS = (  # header, row key, format, width
    ("req/s", "requests_per_s", ".0f", 8), ("us/req", "api_cpu_us_per_request", ".0f", 8),
    ("eff", "request_scaling", ".2f", 6), ("tok/s", "tokens_per_s", ".0f", 9), ("eff", "token_scaling", ".2f", 6),
    ("us/tok", "api_cpu_us_per_token_saturated", ".1f", 8), ("ev/tok", "events_per_token_saturated", ".2f", 7),
    ("paced us/tok", "api_cpu_us_per_token", ".1f", 13), ("ev/tok", "events_per_token", ".2f", 7),
    ("RSS MB", "rss_mb_max", ".0f", 7),
)


def print_table(rows: list[dict]) -> None:
    header = "".join(f"{h:>{w}}" for h, _, _, w in COLUMNS)
    width = max(22, *(len(r["label"]) + 1 for r in rows))
    print(f"{'server':<{width}}{header}{'engine%':>8}{'client%':>8}{'errors':>7}")
    for r in rows:
        busiest = r["phases"].get("streams") or r["phases"]["paced"]
        # the busiest engine process: the one that would cap the throughput
        engine = max((v for k, v in busiest["other_cpu_share"].items() if "Engine" in k or "child" in k), default=0)
        errors = sum(sum(p["errors"].values()) for p in r["phases"].values())
        print(f"{r['label']:<{width}}" + "".join(_cell(r[k], f, w) for _, k, f, w in COLUMNS)
              + f"{engine * 100:>8.0f}{busiest['client_cpu_share'] * 100:>8.0f}{errors:>7}")
    for r in rows:
        servers = ", ".join(f"{name} {mb:.0f} MB{' (torch loaded)' if r['torch_loaded'].get(name) else ''}"
                            for name, mb in sorted(r["rss_mb_by_server"].items()))
        print(f"  {r['label']}: RSS {servers}; torch loaded in {sum(r['torch_loaded'].values())} of "
              f"{len(r['torch_loaded'])} API server(s)")
    print(f"targets: <= {TARGETS['us_per_request']:g} us of API-server CPU per 1-token chat completion, "
          f"<= {TARGETS['us_per_token']:g} us per streamed token (paced), "
          f"< {TARGETS['rss_mb']:g} MB RSS per API server, torch loaded in none")
    print("us/req, us/tok: CPU of all API servers together per request / per streamed token; eff: throughput of N / "
          "(N x throughput of one);\nev/tok: SSE events (gRPC: messages) per token (below 1: tokens coalesced under saturation); "
          "engine%: the busiest engine process's CPU share, client%: the clients' (saturated stream phase)")


def main(argv=None) -> int:
    args = parse_args(argv)
    clients = ClosedLoopClients(args.client_processes)
    grpc_clients = ClosedLoopClients(args.client_processes, worker=grpc_clients_module().grpc_client_process) \
        if args.grpc else None
    rows = []
    try:
        for count in args.servers:
            print(f"measuring {count} API server(s) ...", flush=True)
            rows.append(measure_ours(clients, count, args))
            for variant in args.variant:
                print(f"measuring {count} API server(s) with {variant} ...", flush=True)
                rows.append(measure_ours(clients, count, args, variant=variant))
        for count in args.grpc_servers if args.grpc else ():
            print(f"measuring {count} gRPC API server(s) ...", flush=True)
            rows.append(measure_ours(grpc_clients, count, args, grpc=True))
        if args.vllm_url:
            print(f"measuring {args.vllm_url} (pid {args.vllm_pid}) ...", flush=True)
            rows.append(measure_other(clients, args))
    finally:
        clients.close()
        if grpc_clients is not None:
            grpc_clients.close()
    add_efficiency(rows)
    setup = (f"per API server: {args.request_concurrency} 1-token requests or {args.stream_concurrency} streams of "
             f"{args.stream_tokens} tokens on sim:{args.sim_ms:g}, {args.paced_concurrency} paced streams of "
             f"{args.paced_tokens} tokens on sim:{args.paced_sim_ms:g}; {args.duration:g} s phases; "
             f"{args.engines} simulated engine(s), {args.client_processes} client process(es); {os.cpu_count()} cores")
    print(f"\n{setup}")
    print_table(rows)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine_info(), "setup": setup, "targets": TARGETS, "args": vars(args),
                       "rows": rows}, f, indent=1)
    if args.plot:
        from frontend_plot import plot_frontend

        plot_frontend([r for r in rows if r["label"].startswith("supervise x")], setup, args.plot, TARGETS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
