"""The short table that ends bench/device.sh: each step's outcome and the headline figures against their targets.

    python3 bench/device_summary.py OUT_DIR STEPS_FILE

Reads what the steps left in OUT_DIR (engine.txt, frontend.json, serve.json); a missing file is a step that
failed, shown as such rather than stopping the summary.
"""
from __future__ import annotations

import json
import os
import re
import sys


def engine_rows(path: str) -> list[tuple[str, str, str]]:
    """(figure, value, target) from bench/engine.py's table: its many-request rows."""
    if not os.path.isfile(path):
        return [("engine", "no result", "")]
    rates = {}
    workload = "?"
    for line in open(path):
        shape = re.match(r"(\d+) prompts x (\d+) tokens, (\d+) output tokens", line)
        if shape:
            workload = f"{shape.group(1)} x ({shape.group(2)}+{shape.group(3)})"
        match = re.match(
            r"(\d+) requests\s+(transformers generate.*?|supervise engine core)\s+\d+\s+[\d.]+\s+([\d.]+)", line
        )
        if match:
            rates["engine" if match.group(2).startswith("supervise") else "transformers"] = float(match.group(3))
    rows = []
    if "engine" in rates:
        rows.append((f"engine: out tok/s, {workload}", f"{rates['engine']:.0f}", ">= 20000"))
    if "transformers" in rates:
        rows.append(("transformers generate: out tok/s", f"{rates['transformers']:.0f}", "(about 12000)"))
        if "engine" in rates:
            rows.append(("engine / transformers", f"{rates['engine'] / rates['transformers']:.2f}", ""))
    return rows or [("engine", "no table in engine.txt", "")]


def frontend_rows(path: str) -> list[tuple[str, str, str]]:
    if not os.path.isfile(path):
        return [("frontend", "no result", "")]
    rows = {r["api_servers"]: r for r in json.load(open(path))["rows"] if r["label"].startswith("supervise")}
    out = []
    for n, r in sorted(rows.items()):
        out.append((f"frontend x{n}: streamed tok/s", f"{r['tokens_per_s']:.0f}", ""))
        out.append((f"frontend x{n}: requests/s", f"{r['requests_per_s']:.0f}", ""))
    if 1 in rows and len(rows) > 1:
        most = max(rows)
        ratio = rows[most]["tokens_per_s"] / rows[1]["tokens_per_s"]
        out.append((f"frontend: tok/s of {most} / tok/s of 1", f"{ratio:.2f}", ">= 6" if most == 8 else ""))
    if 1 in rows:
        out.append(("frontend: API CPU us per request", f"{rows[1]['api_cpu_us_per_request']:.0f}", "<= 1000"))
        out.append(("frontend: API CPU us per token (paced)", f"{rows[1]['api_cpu_us_per_token']:.1f}", "<= 40"))
    out.append(("frontend: RSS MB per API server (max)", f"{max(r['rss_mb_max'] for r in rows.values()):.0f}", "< 200"))
    with_torch = sum(sum(r.get("torch_loaded", {}).values()) for r in rows.values())
    out.append(("frontend: API servers with torch loaded", str(with_torch), "0"))
    return out


def serve_rows(path: str) -> list[tuple[str, str, str]]:
    if not os.path.isfile(path):
        return [("serve", "no result", "")]
    s = json.load(open(path))["runs"][0]["summary"]
    return [
        ("serve: completed / failed", f"{s['completed']} / {s['failed']}", "0 failed"),
        ("serve: output tok/s", f"{s['output_throughput']:.0f}", ""),
        ("serve: TTFT p50 / p99 ms", f"{s['ttft_ms']['p50'] or 0:.0f} / {s['ttft_ms']['p99'] or 0:.0f}", ""),
        ("serve: TPOT p50 / p99 ms", f"{s['tpot_ms']['p50'] or 0:.1f} / {s['tpot_ms']['p99'] or 0:.1f}", ""),
    ]


def main() -> None:
    out_dir, steps_file = sys.argv[1], sys.argv[2]
    print(f"\n{'step':<16}{'exit':>8}{'seconds':>9}")
    for line in open(steps_file) if os.path.isfile(steps_file) else ():
        name, rc, seconds = line.split()
        print(f"{name:<16}{rc:>8}{seconds:>9}")
    rows = []
    for reader, name in ((engine_rows, "engine.txt"), (frontend_rows, "frontend.json"), (serve_rows, "serve.json")):
        try:
            rows += reader(os.path.join(out_dir, name))
        except Exception as exc:  # a half-written file must not hide the other figures
            rows.append((name, f"unreadable: {exc}", ""))
    print(f"\n{'figure':<42}{'value':>16}  target")
    for figure, value, target in rows:
        print(f"{figure:<42}{value:>16}  {target}")


if __name__ == "__main__":
    main()
