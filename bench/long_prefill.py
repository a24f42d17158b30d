"""A short chat behind a long prompt: how long the chat waits, with the long prompt's chunk capped while others run
or wait (--long-prefill-token-threshold, default a quarter of the step's budget) and without a cap (0: a long
prompt takes every step's budget until its prefill is done, vLLM's default). Both groups in one run, side by side.

    .venv/bin/python bench/long_prefill.py                    # the embedded model, 8,000 tokens of prompt
    .venv/bin/python bench/long_prefill.py --words 4000 --args "--max-num-batched-tokens 512"
    .venv/bin/python bench/long_prefill.py --long-prompts 4 --words 6000   # four at once, each capped

Target: the chat waits at most half as long as without a cap (where it waited for the whole prefill). On a CPU a
step's time grows with the long prompt's context, so the chat's few steps stay long: a smaller threshold
(`--args "--long-prefill-token-threshold 128"`) shortens them further.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from supervise_launcher import start_supervise  # noqa: E402


def measure(extra: str, words: int, lead_s: float, long_prompts: int = 1) -> tuple[float, float, float]:
    """(seconds to the chat's first token, seconds the chat took, seconds the last long prompt took) in a group
    started with `extra`."""
    server = start_supervise(extra)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        took: dict[str, float] = {}

        def long_prompt(i: int) -> None:
            started = time.monotonic()
            # Each its own first word: no prompt finds another's tokens in the prefix cache.
            httpx.post(f"{server.url}/v1/completions", timeout=900,
                       json={"model": model, "prompt": f"{i} " + "apple " * words, "max_tokens": 1}).raise_for_status()
            took["long"] = max(took.get("long", 0.0), time.monotonic() - started)

        readers = [threading.Thread(target=long_prompt, args=(i,)) for i in range(long_prompts)]
        for reader in readers:
            reader.start()
        time.sleep(lead_s)
        started = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=600, json={
                "model": model, "max_tokens": 5, "stream": True,
                "messages": [{"role": "user", "content": "Say hi."}]}) as chat:
            chat.raise_for_status()
            for line in chat.iter_lines():
                if "first" not in took and '"content":"' in line:
                    took["first"] = time.monotonic() - started
        took["chat"] = time.monotonic() - started
        for reader in readers:
            reader.join()
        return took.get("first", took["chat"]), took["chat"], took["long"]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, default=8000, help="the long prompt: this many 'apple ' (a token each)")
    parser.add_argument("--long-prompts", type=int, default=1, help="long prompts sent at once, each its own")
    parser.add_argument("--lead", type=float, default=1.0, help="seconds between the long prompt and the chat")
    parser.add_argument("--args", default="", help="more supervise options for both groups")
    args = parser.parse_args()
    rows = []
    for label, extra in (("capped (default)", args.args), ("no cap (0)", f"{args.args} --long-prefill-token-threshold 0")):
        first, chat, long = measure(extra, args.words, args.lead, args.long_prompts)
        rows.append((label, chat, long))
        print(f"{label:18} chat's first token {first:6.2f} s, all {chat:6.2f} s   long prompt {long:6.2f} s",
              flush=True)
    capped, uncapped = rows[0][1], rows[1][1]
    verdict = "met" if capped <= uncapped / 2 else "NOT met"
    print(f"target: the chat capped at most half its wait without a cap: {capped:.2f} s against {uncapped:.2f} s "
          f"({capped / uncapped:.0%}): {verdict}")


if __name__ == "__main__":
    main()
