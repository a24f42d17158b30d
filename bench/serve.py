"""End-to-end load on any OpenAI-compatible server: throughput, TTFT, TPOT, ITL and latency percentiles.

Random prompts of an exact token length (the embedded model's tokenizer), chat or text completions, streamed
or not, sent in a closed loop (`--max-concurrency`) or an open one (Poisson `--request-rate`). Give several
`--base-url`s (ours, vLLM, ...) and the same prompts run against each in turn, printed side by side with the
ratio to the first; `--start-supervise "ARGS"` starts our own server first and measures it as the first, and
charges its API server processes' CPU (the kernel's accounting) per request.

    .venv/bin/python bench/serve.py --start-supervise "--model sim:10" --num-prompts 200 --max-concurrency 32
    .venv/bin/python bench/serve.py --start-supervise "" --base-url http://127.0.0.1:8100 \\
        --num-prompts 64 --max-concurrency 32 --input-len 32 --output-len 64 --result-json r.json --plot r.png

A base URL without a trailing /v1 gets one. Without `--model`, the first model the server lists is used.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from http_client import HttpClient  # noqa: E402
from latency_stats import samples, summarize  # noqa: E402
from load_pattern import run_load  # noqa: E402
from machine_info import machine_info  # noqa: E402
from openai_request import request_body, send  # noqa: E402
from process_usage import cpu_seconds, titled_children  # noqa: E402
import api_profile  # noqa: E402
from prompts import RandomPrompts, embedded_tokenizer_dir  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=[], help="a server to load (repeat for side by side)")
    p.add_argument("--model", action="append", default=[],
                   help="model name for the --base-url servers: once for all, or once per URL in order")
    p.add_argument("--label", action="append", default=[],
                   help="a name per --base-url server in the table and plot (ours is `supervise`)")
    p.add_argument("--start-supervise", metavar="ARGS", default=None,
                   help='start our supervise with these options first (e.g. "--model sim:10"; "" for defaults)')
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses, not SSE")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (before any chat template)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop early (default: exactly --output-len tokens)")
    p.add_argument("--max-concurrency", type=int, default=None, help="closed loop: most requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="open loop: mean requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent and ignored before measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--max-duration", type=float, default=None, help="send no new request after these seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="a model directory with tokenizer.json (default: embedded)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds --start-supervise may take")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the latency CDFs")
    p.add_argument("--profile-api-server", metavar="PATH", default=None,
                   help="with --start-supervise: py-spy samples ApiServer_0 during the measured run (collapsed "
                        "stacks to PATH) and its costliest functions are printed")
    args = p.parse_args(argv)
    if args.start_supervise is None and not args.base_url:
        p.error("give --base-url, --start-supervise, or both")
    return args


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def discover_model(client: HttpClient) -> str:
    status, body = await client.get("/models")
    if status != 200:
        raise SystemExit(f"GET /models answered {status}: give --model")
    return json.loads(body)["data"][0]["id"]


async def measure(base_url: str, model: str | None, warmup: list[str], prompts: list[str], args,
                  api_servers: dict | None = None) -> dict:
    """api_servers: our API server processes by title, when we started the server: their CPU is charged too."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    client = HttpClient(base_url, headers)
    profiler = None
    try:
        model = model or await discover_model(client)
        chat = args.endpoint == "chat"
        def bodies(texts: list[str]) -> list[bytes]:
            return [request_body(model, t, args.output_len, chat, args.stream, args.ignore_eos) for t in texts]

        async def one(body: bytes):
            return await send(client, body, chat, args.stream, args.timeout)

        warm, _ = await run_load(one, bodies(warmup), max_concurrency=args.max_concurrency)
        profiled = (api_servers or {}).get("ApiServer_0") if args.profile_api_server else None
        profiler = api_profile.start(profiled.pid, args.profile_api_server) if profiled else None
        if profiler is not None:
            await asyncio.sleep(api_profile.ATTACH_S)  # sampling from the measured run's first request on
        cpu_before = time.process_time()
        servers_before = cpu_seconds(api_servers or {})
        deadline = time.monotonic() + args.max_duration if args.max_duration else None
        records, duration = await run_load(one, bodies(prompts), args.max_concurrency, args.request_rate, args.seed,
                                           deadline)
        client_cpu = time.process_time() - cpu_before
        servers_cpu = sum(cpu_seconds(api_servers or {}).values()) - sum(servers_before.values())
    finally:
        api_profile.stop(profiler)  # also when the run failed: py-spy writes what it has
        client.close()
    summary = summarize(records, duration)
    summary["client_cpu_us_per_request"] = client_cpu / max(1, len(records)) * 1e6
    summary["client_cpu_share"] = client_cpu / duration if duration else 0.0
    summary["api_servers_cpu_us_per_request"] = (servers_cpu / max(1, len(records)) * 1e6) if api_servers else None
    summary["warmup_failed"] = sum(1 for r in warm if not r.ok)
    return {"base_url": base_url, "model": model, "summary": summary, "samples": samples(records)}


ROWS = (
    ("completed / failed", lambda s: f"{s['completed']} / {s['failed']}", None),
    ("duration (s)", lambda s: f"{s['duration_s']:.2f}", None),
    ("requests/s", lambda s: f"{s['request_throughput']:.2f}", "request_throughput"),
    ("output tokens/s", lambda s: f"{s['output_throughput']:.1f}", "output_throughput"),
    ("total tokens/s", lambda s: f"{s['total_token_throughput']:.1f}", "total_token_throughput"),
    ("mean prompt / output tokens", lambda s: f"{s['mean_prompt_tokens']:.0f} / {s['mean_output_tokens']:.0f}", None),
    *[
        (f"{name} {stat} (ms)", (lambda s, m=metric, st=stat: _ms(s[m][st])), (metric, stat))
        for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
        for stat in ("mean", "p50", "p90", "p99")
    ],
    ("client CPU us/request", lambda s: f"{s['client_cpu_us_per_request']:.0f}", None),
    # Near 100%, the one client process (not the server) may be what limits the run.
    ("client CPU, share of a core", lambda s: f"{s['client_cpu_share']:.0%}", None),
    ("API servers CPU us/request", lambda s: _us(s.get("api_servers_cpu_us_per_request")),
     "api_servers_cpu_us_per_request"),
    ("errors by status", lambda s: json.dumps(s["errors_by_status"]) if s["errors_by_status"] else "-", None),
)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _us(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _value(summary: dict, key):
    if isinstance(key, tuple):
        return summary[key[0]][key[1]]
    return summary[key]


def print_table(runs: list[dict]) -> None:
    labels = [run["label"] for run in runs]
    width = max(16, *(len(label) + 2 for label in labels))
    header = f"{'':<30}" + "".join(f"{label:>{width}}" for label in labels)
    if len(runs) > 1:
        header += "".join(f"{'ratio ' + str(i + 1) + '/1':>14}" for i in range(1, len(runs)))
    print(header)
    for name, fmt, key in ROWS:
        line = f"{name:<30}" + "".join(f"{fmt(run['summary']):>{width}}" for run in runs)
        if len(runs) > 1 and key is not None:
            first = _value(runs[0]["summary"], key)
            for run in runs[1:]:
                other = _value(run["summary"], key)
                line += f"{other / first:>14.2f}" if first and other is not None else f"{'-':>14}"
        print(line)
    for run in runs:
        for error in run["summary"]["first_errors"]:
            print(f"  {run['label']}: {error}")


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts_source = RandomPrompts(args.tokenizer or embedded_tokenizer_dir(), args.seed)
    # The same prompts for every server; the warm-up prompts are extra ones, so nothing measured is cached.
    prompts = prompts_source.prompts(args.num_prompts, args.input_len)
    warmup = prompts_source.prompts(args.warmup, args.input_len)
    targets = [(url, None) for url in args.base_url]
    server = None
    if args.start_supervise is not None:
        from supervise_launcher import start_supervise

        print(f"starting supervise {args.start_supervise}", flush=True)
        server = start_supervise(args.start_supervise, args.server_timeout)
        targets.insert(0, (server.url, "supervise"))
    try:
        import uvloop

        run_loop = uvloop.run  # a cheaper event loop: the client shares the CPU with the server
    except ImportError:
        run_loop = asyncio.run
    runs = []
    try:
        for i, (url, label) in enumerate(targets):
            url_index = i - (server is not None)  # --model and --label pair with --base-url
            ours = server is not None and i == 0
            api_servers = ({title: p for title, p in titled_children(server.pid).items() if title.startswith("ApiServer")}
                           if ours else None)
            run = run_loop(measure(api_base(url), _model_for(args, url_index), warmup, prompts, args, api_servers))
            run["label"] = label or (args.label[url_index] if url_index < len(args.label) else url)
            runs.append(run)
            print(f"{run['label']}: {run['summary']['completed']} requests in {run['summary']['duration_s']:.1f} s",
                  flush=True)
    finally:
        if server is not None:
            server.stop()
    engine_lines = [line for line in server.log().splitlines() if "engine: " in line] if server else []
    if engine_lines:  # the engine's own account of the run (--log-stats-interval): steps, eager ones, ms a step
        print("\nthe engine's log during the run:\n" + "\n".join(engine_lines[-8:]))
    load = (f"{args.endpoint}, {'streamed' if args.stream else 'whole'}, {args.num_prompts} prompts of "
            f"{args.input_len} tokens ({prompts_source.source}), {args.output_len} output tokens, "
            f"concurrency {args.max_concurrency or 'unlimited'}, rate {args.request_rate:g}/s")
    print(f"\n{load}")
    print_table(runs)
    if args.profile_api_server and os.path.isfile(args.profile_api_server):
        print(f"\nApiServer_0 during the run (py-spy, {args.profile_api_server}):")
        print("\n".join(api_profile.top(args.profile_api_server)))
    result = {"machine": machine_info(), "load": load, "args": vars(args), "engine_log": engine_lines,
              "runs": [{k: v for k, v in run.items() if k != "samples"} for run in runs]}
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        from serve_plot import plot_latency_cdfs

        plot_latency_cdfs([(run["label"], run["samples"]) for run in runs], load, args.plot)
    return 0 if all(run["summary"]["failed"] == 0 for run in runs) else 1


def _model_for(args, url_index: int) -> str | None:
    """--model values pair with --base-url values in order; our own started server is asked its name."""
    if url_index < 0 or not args.model:
        return None
    return args.model[min(url_index, len(args.model) - 1)]


if __name__ == "__main__":
    sys.exit(main())
