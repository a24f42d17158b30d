"""A py-spy profile of one API server while a benchmark loads it, and its costliest functions.

py-spy samples the process from outside, pausing it for each sample (about 1-2% of its time at 250 Hz): without
pausing (`--nonblocking`) a run here gave a third of the samples and stacks that put a 1 us constructor at 17%.
Its collapsed stacks ("frame;frame;... count" lines) go to a file, and `top` reads them back: each function's
share of the event loop thread's samples with it anywhere on the stack (inclusive) and at the top (self).

    .venv/bin/python bench/api_profile.py PROFILE.txt     # the table of a profile recorded before
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys

RATE_HZ = 250
ATTACH_S = 1.0  # what py-spy takes to start sampling, with room to spare


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this Python (a venv's bin)."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.path.exists(beside) else None)


def start(pid: int, path: str) -> subprocess.Popen | None:
    """Start sampling `pid` into `path`; None (and a line saying why) when py-spy is not there."""
    executable = py_spy()
    if executable is None:
        print("no py-spy here: the API server is not profiled", flush=True)
        return None
    return subprocess.Popen([executable, "record", "--pid", str(pid), "--rate", str(RATE_HZ),
                             "--format", "raw", "--output", path], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def stop(profiler: subprocess.Popen | None) -> None:
    """Stop sampling; py-spy writes its file on SIGINT."""
    if profiler is None:
        return
    profiler.send_signal(signal.SIGINT)
    try:
        _, errors = profiler.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        profiler.kill()
        errors = "py-spy did not stop"
    if profiler.returncode not in (0, -signal.SIGINT):
        print(f"py-spy ended with {profiler.returncode}: {(errors or '').strip()[-500:]}", flush=True)


def _function(frame: str) -> str:
    """'name (path/to/file.py:123)' -> 'name (file.py)': one row per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.rsplit(':', 1)[0])})" if where else name


def _on_event_loop(stack: str) -> bool:
    """Whether a stack is the event loop's thread: an API server's other threads (the parent watch, the tokenize
    pool) mostly wait, and py-spy without pausing the process counts some waits as busy."""
    return any(marker in stack for marker in _EVENT_LOOP_FRAMES)


_EVENT_LOOP_FRAMES = ("Runner.run (", "run_forever (", "run_until_complete (")


def top(path: str, count: int = 25) -> list[str]:
    """The `count` costliest functions of a collapsed-stacks file, inclusive and self, as table lines."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = others = 0
    with open(path) as f:
        for line in f:
            stack, _, samples = line.rstrip("\n").rpartition(" ")
            if not stack or not samples.isdigit():
                continue
            n = int(samples)
            if not _on_event_loop(stack):
                others += n
                continue
            total += n
            functions = [_function(frame) for frame in stack.split(";")]
            for function in set(functions):
                inclusive[function] += n
            own[functions[-1]] += n
    if not total:
        return [f"{path}: no samples"]
    lines = [f"{total} samples of the event loop's thread at {RATE_HZ} Hz ({others} of other threads left out); share "
             "of them with the function on the stack / on top (the trunk, on 95% or more of them, left out)"]
    branches = [(function, n) for function, n in inclusive.most_common() if n < 0.95 * total]
    for function, n in branches[:count]:
        lines.append(f"  {100 * n / total:5.1f}% {100 * own[function] / total:5.1f}%  {function}")
    lines.append("  on top most often:")
    for function, n in own.most_common(count // 2):
        lines.append(f"  {100 * inclusive[function] / total:5.1f}% {100 * n / total:5.1f}%  {function}")
    return lines


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print("\n".join(top(path)))
