"""An API server's CPU for stop strings: one completion of `--n` choices x `--tokens` tokens from the simulated
engine, with no stop strings and with stop strings that never match (so every token is looked at), at the
--max-stop-string-chars limit (64 strings of 128 characters): their last character rare in the text (digits), or
one most tokens hold ('e'); and an agent's four short ones. Target: each at most 2x the CPU without stop strings.

    .venv/bin/python bench/stop_strings.py [--n 16] [--tokens 8000]
"""
from __future__ import annotations

import argparse
import os
import sys

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402

TARGET_RATIO = 2.0
CASES = {
    "64 x 128 characters, ending in a digit": [f"{'~' * 126}{i:02d}" for i in range(64)],
    "64 x 128 characters, ending in 'e'": [f"{'~' * 125}{i:02d}e" for i in range(64)],
    "an agent's 4": ["\nObservation:", "\n\n\n", "</answer>", "User:"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8000)
    args = p.parse_args()
    print(machine_info())
    server = start_supervise(f"--model sim:1 --max-model-len {args.tokens + 64}")
    try:
        api = server.child_titled("ApiServer_0")

        def cpu_of(stop) -> float:
            before = api.cpu_times()
            body = {"model": "sim:1", "prompt": "hello", "max_tokens": args.tokens, "n": args.n, "stop": stop,
                    "ignore_eos": True}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            after = api.cpu_times()
            return after.user + after.system - before.user - before.system

        cpu_of(None)  # warm: the tokenizer's caches
        alone = cpu_of(None)
        tokens = args.n * args.tokens
        print(f"{tokens:,} tokens without stop strings: {alone:.2f} s of ApiServer_0's CPU "
              f"({alone / tokens * 1e6:.1f} us a token)")
        for label, stop in CASES.items():
            took = cpu_of(stop)
            ratio = took / alone
            print(f"{label}: {took:.2f} s, {ratio:.2f}x (target <= {TARGET_RATIO}x): "
                  f"{'PASS' if ratio <= TARGET_RATIO else 'FAIL'}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
