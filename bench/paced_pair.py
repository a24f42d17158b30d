"""Two groups under the same paced load at the same time: API-server CPU per streamed token, side by side
(`--requests`: per short whole chat completion instead).

bench/frontend.py's paced phase measures one group after the other, and on a shared machine two runs a minute
apart differ by 10-20%: more than most changes to the per-token path. Here both groups serve at once, each its
own closed loop of paced streams (the same request, the same concurrency), so whatever the neighbours do, both
pay it. Each round charges each group's API server with the CPU time the kernel counted for it
(/proc/PID/schedstat, in nanoseconds) and prints both figures and their ratio; the median of the ratios ends.

The second group ("b") is ours with `--b-args` added, or the checkout at `--b-tree` (a git worktree of another
commit, put first on its PYTHONPATH), or both:

    .venv/bin/python bench/paced_pair.py --b-args=--no-direct-stream-events
    .venv/bin/python bench/paced_pair.py --requests --sim-ms 1 --b-tree /tmp/before   # 1-token chats, not streamed
    git worktree add /tmp/before HEAD~3 && .venv/bin/python bench/paced_pair.py --b-tree /tmp/before
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from closed_loop_clients import ClosedLoopClients  # noqa: E402
from frontend import CHAT_PATH, PROMPT  # noqa: E402
from machine_info import machine_info  # noqa: E402
from openai_request import request_body  # noqa: E402
from process_usage import cpu_ns, titled_children  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b-args", default="", metavar="ARGS", help="extra supervise options of group b")
    p.add_argument("--b-tree", default=None, metavar="PATH", help="group b runs the checkout at PATH")
    p.add_argument("--sim-ms", type=float, default=20.0, help="the simulated engine's step interval (the pace)")
    p.add_argument("--concurrency", type=int, default=32, help="paced streams in flight per group")
    p.add_argument("--tokens", type=int, default=64, help="tokens of each stream")
    p.add_argument("--requests", action="store_true",
                   help="load both with 1-token chat completions, not streamed (bench/frontend.py's requests phase), "
                        "and charge CPU per request")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of each round")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--server-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if not args.b_args and not args.b_tree:
        p.error("give --b-args, --b-tree or both: group b must differ from group a")
    return args


def start_group(args, extra: str, tree: str | None):
    """A serving group with one API server, and that server's pid; `tree`: the checkout it runs."""
    saved = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = os.path.abspath(tree) + (os.pathsep + saved if saved else "")
    try:
        server = start_supervise(["--model", f"sim:{args.sim_ms:g}", "--max-num-seqs", "65536", *shlex.split(extra)],
                                 args.server_timeout)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    (api,) = [p for name, p in titled_children(server.pid).items() if name.startswith("ApiServer_")]
    return server, api.pid


def run_round(groups, clients, body: bytes, args, duration: float) -> list[dict]:
    """Both loads at once; per group: its tokens, events and API-server CPU ns."""
    before = [cpu_ns(pid) for _, pid in groups]
    done: list = [None, None]

    def load(i: int) -> None:
        done[i] = clients[i].run(groups[i][0].url, CHAT_PATH, body, args.concurrency, duration, args.tokens)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [{**done[i], "cpu_ns": cpu_ns(pid) - before[i]} for i, (_, pid) in enumerate(groups)]


def main(argv=None) -> int:
    args = parse_args(argv)
    labels = ("a: supervise", f"b: supervise {args.b_args}".strip() + (f" ({args.b_tree})" if args.b_tree else ""))
    load = "1-token chat completions" if args.requests else f"paced streams of {args.tokens} tokens"
    print(f"{machine_info()}\n{args.concurrency} {load} in flight on sim:{args.sim_ms:g} per group, both at once; "
          f"{args.rounds} rounds of {args.duration:g} s\n  {labels[0]}\n  {labels[1]}", flush=True)
    model = f"sim:{args.sim_ms:g}"
    if args.requests:
        args.tokens = 1
        body = request_body(model, PROMPT, 1, chat=True, stream=False, ignore_eos=False)
    else:
        body = request_body(model, PROMPT, args.tokens, chat=True, stream=True, ignore_eos=True)
    unit = "requests" if args.requests else "tokens"
    groups, clients = [], []
    try:
        groups.append(start_group(args, "", None))
        groups.append(start_group(args, args.b_args, args.b_tree))
        clients += [ClosedLoopClients(1), ClosedLoopClients(1)]
        run_round(groups, clients, body, args, args.warmup)
        ratios = []
        per_unit = "req" if args.requests else "tok"
        print(f"round   a us/{per_unit}   b us/{per_unit}    b/a" + ("" if args.requests else "   a ev/tok  b ev/tok"))
        for r in range(args.rounds):
            a, b = run_round(groups, clients, body, args, args.duration)
            per = [g["cpu_ns"] / 1e3 / max(1, g[unit]) for g in (a, b)]
            ratios.append(per[1] / per[0])
            events = "" if args.requests else (f" {a['events'] / max(1, a['tokens']):10.2f}"
                                               f" {b['events'] / max(1, b['tokens']):9.2f}")
            print(f"{r:5d} {per[0]:10.1f} {per[1]:10.1f} {ratios[-1]:6.3f}{events}", flush=True)
            for label, g in zip("ab", (a, b)):
                if g["errors"]:
                    print(f"      errors of {label}: {g['errors']}", flush=True)
        print(f"median b/a: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    finally:
        for c in clients:
            c.close()
        for server, _ in groups:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
