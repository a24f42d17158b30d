"""What a streamed chat answer costs the API server per delta, by its length, where the request has tools: each
parser (`--tool-call-parser`, and `tool_choice: required`) fed, four characters at a time, a file-writing call of
5, 20 and 40 KB (as a coding agent's `write_file` arrives), then an answer without calls of 5, 40 and 160 KB after
as much reasoning (`--reasoning-parser`). A call is parsed again after every delta, with what the scans of its
shorter text found (apiserver/tool_parsers/json_scan.py); content is kept only from where a call may begin, and
reasoning only from where a tag may (apiserver/reasoning.py), so a delta should cost the same at any length.
Target: the cost per delta at the longest at most 2x that at the shortest.

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

from apiserver.chat_output import OutputShape, StreamedMessage  # noqa: E402
from apiserver.tool_parsers import TOOL_PARSERS  # noqa: E402
from apiserver.tool_parsers.forced import RequiredCallsParser  # noqa: E402

TARGET_RATIO = 2.0
CALL_SIZES_KB = (5, 20, 40)
CONTENT_SIZES_KB = (5, 40, 160)
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


def answers(size: int) -> dict[str, tuple]:
    """Reasoning, then content without calls, `size` characters of each."""
    prose = "The quick brown fox [jumps] {over} the <lazy> dog; " * (size // 51)
    text = f"<think>{prose}</think>\n\n{prose}"
    return {name: (TOOL_PARSERS[name](), text) for name in ("hermes", "llama3_json", "pythonic")}


def per_delta_us(parser, text: str, reasoning: bool) -> float:
    streamed = StreamedMessage(OutputShape(reasoning, False, parser))
    started = time.process_time()
    for i in range(0, len(text), 4):
        streamed.feed(text[i:i + 4], False)
    streamed.feed("", True)
    return (time.process_time() - started) / (len(text) / 4) * 1e6


def report(what: str, texts, sizes_kb: tuple[int, ...], reasoning: bool) -> None:
    for name in texts(1024):
        # The sizes take turns, and each keeps its least: a shared machine's slow spells fall on all of them.
        runs: dict[int, list[float]] = {kb: [] for kb in sizes_kb}
        for _ in range(ROUNDS):
            for kb in sizes_kb:
                runs[kb].append(per_delta_us(*texts(kb * 1024)[name], reasoning))  # (a fresh parser each run)
        costs = [min(runs[kb]) for kb in sizes_kb]
        ratio = costs[-1] / costs[0]
        figures = ", ".join(f"{kb} KB {us:.1f} us" for kb, us in zip(sizes_kb, costs))
        print(f"{what} {name}: per delta {figures}; {sizes_kb[-1]} KB / {sizes_kb[0]} KB {ratio:.2f}x "
              f"(target <= {TARGET_RATIO}x): {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}")


def main() -> None:
    print(machine_info())
    report("call", calls, CALL_SIZES_KB, False)
    report("reasoning+content", answers, CONTENT_SIZES_KB, True)


if __name__ == "__main__":
    main()
