"""What a streamed tool call costs the API server per delta, by its length: each parser (`--tool-call-parser`,
and `tool_choice: required`) fed a file-writing call of 5, 20 and 40 KB four characters at a time, as a coding
agent's `write_file` arrives. The parser reads the whole text again after every delta, with what its scans of
the shorter text found (apiserver/tool_parsers/json_scan.py), so a delta should cost the same at any length.
Target: the cost per delta at 40 KB at most 2x that at 5 KB.

    .venv/bin/python bench/tool_call_stream.py
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402

from apiserver.tool_parsers import TOOL_PARSERS, ToolCallStream  # noqa: E402
from apiserver.tool_parsers.forced import RequiredCallsParser  # noqa: E402

TARGET_RATIO = 2.0
SIZES_KB = (5, 20, 40)
ROUNDS = 5


def calls(size: int) -> dict[str, tuple]:
    arguments = {"path": "a.py", "content": "def f(x):\n    return x * 2  # \"q\"\n" * (size // 36)}
    text = json.dumps(arguments)
    return {
        "hermes": (TOOL_PARSERS["hermes"](), f'<tool_call>\n{{"name": "write", "arguments": {text}}}\n</tool_call>'),
        "llama3_json": (TOOL_PARSERS["llama3_json"](), f'{{"name": "write", "parameters": {text}}}'),
        "required": (RequiredCallsParser(), f'[{{"name": "write", "parameters": {text}}}]'),
        "pythonic": (TOOL_PARSERS["pythonic"](),
                     "[write(path='a.py', lines=[" + ", ".join(f"({i}, 'x = {i}')" for i in range(size // 14)) + "])]"),
    }


def per_delta_us(parser, text: str) -> float:
    stream = ToolCallStream(parser)
    started = time.process_time()
    for i in range(0, len(text), 4):
        stream.feed(text[i:i + 4], False)
    stream.feed("", True)
    return (time.process_time() - started) / (len(text) / 4) * 1e6


def main() -> None:
    print(machine_info())
    for name in calls(1024):
        # The sizes take turns, and each keeps its least: a shared machine's slow spells fall on all of them.
        runs: dict[int, list[float]] = {kb: [] for kb in SIZES_KB}
        for _ in range(ROUNDS):
            for kb in SIZES_KB:
                runs[kb].append(per_delta_us(*calls(kb * 1024)[name]))  # (a fresh parser each run)
        costs = [min(runs[kb]) for kb in SIZES_KB]
        ratio = costs[-1] / costs[0]
        figures = ", ".join(f"{kb} KB {us:.1f} us" for kb, us in zip(SIZES_KB, costs))
        print(f"{name}: per delta {figures}; 40 KB / 5 KB {ratio:.2f}x (target <= {TARGET_RATIO}x): "
              f"{'PASS' if ratio <= TARGET_RATIO else 'FAIL'}")


if __name__ == "__main__":
    main()
