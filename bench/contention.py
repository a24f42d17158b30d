"""The engine's decode speed alone and beside a busy neighbour, for each way of choosing its thread count.

A neighbour is `--hogs` processes spinning in a loop (default: half the cores, one on a 2-core box). For each
thread setting (the engine's default: brief OpenMP spins and the thread governor of enginecore/cpu_threads.py;
fixed OMP_NUM_THREADS values; sleeping, spinning or N-round waits), a child process loads the engine as `supervise` would and times greedy decoding of
`--streams` streams, rounds alternating alone / beside the hogs; the table gives medians and the slowdown.
Target (issue 16): beside one busy core of two, no more than 1.5x slower than alone.

    .venv/bin/python bench/contention.py
    .venv/bin/python bench/contention.py --streams 1 8 --rounds 3 --threads default 1 2:spin --quantization none
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = "while True: pass"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", nargs="+", default=["default", "1", f"{cores}:spin"],
                   help="settings to compare: default (the engine's: brief spins, the thread governor) or a fixed "
                        "OMP_NUM_THREADS, each optionally with ':passive' (sleep at once), ':spin' (libgomp's own "
                        "default: spin 300,000 rounds, then sleep), ':spin=N' (N rounds) or ':active' (spin only)")
    p.add_argument("--hogs", type=int, default=max(1, cores // 2), help="busy processes beside the engine")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="alone / beside rounds per setting, interleaved")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def child(args) -> None:
    """Load the engine once, then time one decode per line read from stdin ('<streams>'), answer tok/s."""
    sys.path.insert(0, REPO)
    import enginecore  # noqa: F401  (first: OpenMP settings before torch loads)
    import torch
    from enginecore.engine import EngineCore
    from ipc.config import ServeConfig
    from ipc.messages import EngineRequest
    from ipc.sampling import SamplingParams

    core = EngineCore(ServeConfig(device="cpu", quantization=args.quantization, max_model_len=512,
                                  enable_prefix_caching=False, kv_cache_memory=256 * 2**20))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = torch.randint(100, 30000, (64, 16), generator=torch.Generator().manual_seed(0)).tolist()
    core.generate([EngineRequest("warm", prompts[0], SamplingParams(max_tokens=8, temperature=0.0))])
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        streams = int(line)
        requests = [EngineRequest(f"{n}-{i}", prompts[i], params) for i in range(streams)]
        n += 1
        for r in requests:  # prefill first, untimed: the table is about decoding
            core.add_request(r)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running) \
                or core.scheduler.num_waiting:
            core.step()
        started = time.perf_counter()
        produced = 0
        while core.has_work():
            produced += sum(len(o.new_token_ids) for _, o in core.step())
        threads = torch.get_num_threads()
        print(json.dumps({"tok_s": produced / (time.perf_counter() - started), "threads": threads}), flush=True)


def start_child(setting: str, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    threads, _, policy = setting.partition(":")
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    if policy == "spin":
        env.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="300000")
    elif policy.startswith("spin="):  # spin this many rounds, then sleep
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin=")
    elif policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", setting, "--output-len", str(args.output_len),
           "--quantization", args.quantization]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while proc.stdout.readline().strip() != "ready":
        if proc.poll() is not None:
            raise SystemExit(f"the engine for threads={setting} failed to start")
    return proc


def measure(proc: subprocess.Popen, streams: int) -> dict:
    proc.stdin.write(f"{streams}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores, {args.hogs} hog(s), quantization {args.quantization}, {args.output_len} tokens a stream, "
          f"median of {args.rounds} interleaved rounds; load average now {os.getloadavg()[0]:.1f}", flush=True)
    children = {setting: start_child(setting, args) for setting in args.threads}
    results = {(s, n, hog): [] for s in args.threads for n in args.streams for hog in (False, True)}
    threads_seen = {key: set() for key in results}
    try:
        for _ in range(args.rounds):
            for hog in (False, True):
                hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs if hog else 0)]
                try:
                    for setting, proc in children.items():
                        for streams in args.streams:
                            r = measure(proc, streams)
                            results[(setting, streams, hog)].append(r["tok_s"])
                            threads_seen[(setting, streams, hog)].add(r["threads"])
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
    finally:
        for proc in children.values():
            proc.stdin.close()
            proc.wait()
    print(f"\n{'threads':>8}{'streams':>9}{'alone tok/s':>13}{'beside hog':>12}{'slowdown':>10}  threads used")
    for setting in args.threads:
        for streams in args.streams:
            alone = statistics.median(results[(setting, streams, False)])
            beside = statistics.median(results[(setting, streams, True)])
            used = f"{sorted(threads_seen[(setting, streams, False)])} / {sorted(threads_seen[(setting, streams, True)])}"
            print(f"{setting:>8}{streams:>9}{alone:>13.1f}{beside:>12.1f}{alone / beside:>9.2f}x  {used}")
    print("\ntarget: slowdown <= 1.5x beside one busy core of two; `default` is the engine's")


if __name__ == "__main__":
    main()
