"""The short table that ends bench/device.sh: each step's outcome and the headline figures against their targets.

    python3 bench/device_summary.py OUT_DIR STEPS_FILE [--bandwidth-tbps 4.8 --peak-tflops 989]

Reads what the steps left in OUT_DIR (engine[-SHAPE].txt, frontend.json, serve[-SHAPE].json, tokenizing.txt,
attention.json); a
missing file is a step that failed, shown as such rather than stopping the summary. Engine and end-to-end rates
are also given as a percentage of their roofline (bench/roofline.py) on the given hardware (default: one H200).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import load_config, roofline  # noqa: E402

# Targets by shape (issue 15): the 135M shape's engine in tokens/s, the 8B's as a share of its roofline.
ENGINE_TARGETS = {"": ">= 50000"}
ROOFLINE_TARGETS = {"llama-3.1-8b": ">= 60%"}


def engine_rows(path: str, shape: str, hardware: dict) -> list[tuple[str, str, str]]:
    """(figure, value, target) from bench/engine.py's table: its many-request rows, and the engine's share of
    the roofline."""
    name = f"engine {shape}".rstrip()
    if not os.path.isfile(path):
        return [(name, "no result", "")]
    rates, workload, model = {}, None, None
    for line in open(path):
        head = re.match(r"model (\S+) on \S+ \((\w+)\)", line)
        if head:
            model = head.groups()
        shape_line = re.match(r"(\d+) prompts x (\d+) tokens, (\d+) output tokens", line)
        if shape_line:
            workload = tuple(int(g) for g in shape_line.groups())
        match = re.match(
            r"(\d+) requests\s+(transformers generate.*?|supervise engine core)\s+\d+\s+[\d.]+\s+([\d.]+)", line
        )
        if match:
            rates["engine" if match.group(2).startswith("supervise") else "transformers"] = float(match.group(3))
    rows = []
    label = f"{workload[0]} x ({workload[1]}+{workload[2]})" if workload else "?"
    if "engine" in rates:
        rows.append((f"{name}: out tok/s, {label}", f"{rates['engine']:.0f}", ENGINE_TARGETS.get(shape, "")))
    if "transformers" in rates:
        rows.append((f"transformers generate{' ' + shape if shape else ''}: out tok/s", f"{rates['transformers']:.0f}",
                     "" if shape else "(about 12000)"))
        if "engine" in rates:
            rows.append((f"{name} / transformers", f"{rates['engine'] / rates['transformers']:.2f}", ""))
    if "engine" in rates and workload and model:
        n, prompt, output = workload
        rows += roofline_rows(name, model[0], model[1], rates["engine"], n, prompt, output, n, shape, hardware)
    return rows or [(name, "no table in the log", "")]


def roofline_rows(name, model_dir, dtype, rate, n, prompt, output, concurrency, shape, hardware) -> list:
    try:
        bound = roofline(load_config(model_dir), dtype, n, prompt, output, concurrency, **hardware)
    except (OSError, KeyError, ValueError) as exc:
        return [(f"{name}: roofline", f"unknown ({exc.__class__.__name__})", "")]
    return [(f"{name}: roofline out tok/s ({bound['bound']})", f"{bound['output_tokens_per_s']:.0f}", ""),
            (f"{name}: % of roofline", f"{100 * rate / bound['output_tokens_per_s']:.1f}%",
             ROOFLINE_TARGETS.get(shape, ""))]


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


def serve_rows(path: str, shape: str, hardware: dict) -> list[tuple[str, str, str]]:
    name = f"serve {shape}".rstrip()
    if not os.path.isfile(path):
        return [(name, "no result", "")]
    result = json.load(open(path))
    s = result["runs"][0]["summary"]
    rows = [
        (f"{name}: completed / failed", f"{s['completed']} / {s['failed']}", "0 failed"),
        (f"{name}: output tok/s", f"{s['output_throughput']:.0f}", ""),
        (f"{name}: TTFT p50 / p99 ms", f"{s['ttft_ms']['p50'] or 0:.0f} / {s['ttft_ms']['p99'] or 0:.0f}", ""),
        (f"{name}: TPOT p50 / p99 ms", f"{s['tpot_ms']['p50'] or 0:.1f} / {s['tpot_ms']['p99'] or 0:.1f}", ""),
    ]
    if s.get("api_servers_cpu_us_per_request") is not None:  # what a request cost our API servers, all of them
        rows.append((f"{name}: API servers CPU us/request", f"{s['api_servers_cpu_us_per_request']:.0f}", ""))
    args = result.get("args", {})
    options = shlex.split(args.get("start_supervise") or "")
    option = lambda flag, default=None: options[options.index(flag) + 1] if flag in options else default  # noqa: E731
    if option("--model") and s["completed"]:
        rows += roofline_rows(name, option("--model"), option("--dtype", "bfloat16"), s["output_throughput"],
                              s["completed"], args["input_len"], args["output_len"],
                              args.get("max_concurrency") or s["completed"], shape, hardware)
    return rows


def profile_rows(path: str, name: str) -> list[tuple[str, str, str]]:
    """bench/step_profile.py's step time and the forward's GPU time."""
    if not os.path.isfile(path):
        return [(name, "no result", "")]
    text = open(path).read()
    step = re.search(r"step: ([\d.]+) ms wall, (\d+) tokens/s", text)
    gpu = re.search(r"GPU time of a step's forward \(events, a second pass\): ([\d.]+) ms", text)
    mode = re.search(r"async scheduling (on|off)", text)
    label = f"{name} (async {mode.group(1) if mode else '?'})"
    if not step:
        return [(label, "no table in the log", "")]
    rows = [(f"{label}: decode step ms / tok/s", f"{float(step.group(1)):.2f} / {step.group(2)}", "")]
    if gpu:
        rows.append((f"{label}: forward on the GPU ms, GPU idle", f"{float(gpu.group(1)):.2f}, "
                     f"{max(0.0, 1 - float(gpu.group(1)) / float(step.group(1))):.0%}", ""))
    return rows


def end_to_end_rows(out_dir: str) -> list[tuple[str, str, str]]:
    """The 135M group's output tok/s against the engine alone's in the same run (issue 15.1: >= 95%)."""
    engine = os.path.join(out_dir, "engine.txt")
    if not os.path.isfile(engine):
        return []
    match = re.search(r"\d+ requests\s+supervise engine core\s+\d+\s+[\d.]+\s+([\d.]+)", open(engine).read())
    # The engine under serve.py's closed loop (bench/engine.py --closed-loop): how much of the gap is the engine's;
    # and the same loop with graphs for decode-only steps only: what graphs of steps with prompt tokens gain.
    loop = _closed_loop_rate(engine)
    rows = []
    if loop:
        rows.append(("engine: out tok/s, closed loop like serve's", f"{loop:.0f}", ""))
    decode_graphs_only = _closed_loop_rate(os.path.join(out_dir, "loop-decode-graphs-only.txt"))
    if decode_graphs_only:
        rows.append(("the same, graphs for decode-only steps only", f"{decode_graphs_only:.0f}", ""))
    for name in ("serve", "serve-through-send", "serve-4-servers", "serve-8-servers"):
        path = os.path.join(out_dir, name + ".json")
        if match and os.path.isfile(path):
            served = json.load(open(path))["runs"][0]["summary"]["output_throughput"]
            rows.append((f"{name} / engine: output tok/s", f"{served / float(match.group(1)):.0%}", ">= 95%"))
            if loop:
                rows.append((f"{name} / engine in the same closed loop", f"{served / loop:.0%}", ""))
    return rows


def tokenizing_rows(path: str) -> list[tuple[str, str, str]]:
    """bench/tokenizing.py's 128-word rows: the event-loop time of a wave of 256 new chats, before and after."""
    if not os.path.isfile(path):
        return []
    rows = []
    for line in open(path):
        cells = line.split()
        if len(cells) == 10 and cells[0] == "128":
            rows.append((f"tokenizing: a wave of 256 {cells[1]} chats, ms", f"{cells[8]} -> {cells[9]}", ""))
    return rows


def attention_rows(path: str) -> list[tuple[str, str, str]]:
    """bench/attention.py's decode rows of 256 sequences per shape: paged Triton (its fastest decode tile) against
    gather + flash; and its RoPE rows: the torch ops against the fused kernel."""
    if not os.path.isfile(path):
        return []
    rows = []
    results = json.load(open(path))
    for row in results["attention"]:
        if not row["step"].startswith("decode 256"):
            continue
        figure = f"attention {row['shape']}, {row['step']}: us a layer"
        flash, paged = (f"{row[k]:.0f}" if row.get(k) is not None else "-" for k in ("flash_us", "best_tile_us"))
        rows.append((figure, f"{flash} -> {paged}", "paged <= flash"))
        if "of_peak" in row:
            rows.append((f"attention {row['shape']}, {row['step']}: paged KV read", f"{row['of_peak']:.0%} of peak",
                         ">= 50%"))
    for row in results["rope"]:
        value = f"{row['torch_us']:.1f} -> {row['fused_us']:.1f}" if "fused_us" in row else "no fused kernel"
        rows.append((f"RoPE + K/V write {row['shape']}: us a layer", value, "fused <= torch"))
    return rows


def _closed_loop_rate(path: str) -> float | None:
    """The out tok/s of bench/engine.py's --closed-loop row in `path`, if there."""
    if not os.path.isfile(path):
        return None
    found = re.search(r"\d+ requests, loop\s+supervise engine core\s+\d+\s+[\d.]+\s+([\d.]+)", open(path).read())
    return float(found.group(1)) if found else None


MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")


def shapes(out_dir: str, prefix: str, suffix: str) -> list[tuple[str, str]]:
    """(shape, path) of OUT_DIR's PREFIX[-SHAPE]SUFFIX files, the unnamed (135M) shape first; SHAPE is one of
    bench/models' (serve-4-servers.json and the like are variants of the 135M run, not shapes)."""
    found = [("", os.path.join(out_dir, prefix + suffix))]
    for path in sorted(glob.glob(os.path.join(out_dir, f"{prefix}-*{suffix}"))):
        shape = os.path.basename(path)[len(prefix) + 1:-len(suffix)]
        if os.path.isdir(os.path.join(MODELS_DIR, shape)):
            found.append((shape, path))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("steps_file")
    p.add_argument("--bandwidth-tbps", type=float, default=4.8, help="memory bandwidth (default: H200 HBM)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense peak of the dtype (default: H200 bf16)")
    args = p.parse_args()
    hardware = {"bandwidth": args.bandwidth_tbps * 1e12, "flops": args.peak_tflops * 1e12}
    print(f"\n{'step':<16}{'exit':>8}{'seconds':>9}")
    for line in open(args.steps_file) if os.path.isfile(args.steps_file) else ():
        name, rc, seconds = line.split()
        print(f"{name:<16}{rc:>8}{seconds:>9}")
    readers = [(lambda path, shape=shape: engine_rows(path, shape, hardware), path)
               for shape, path in shapes(args.out_dir, "engine", ".txt")]
    readers.append((frontend_rows, os.path.join(args.out_dir, "frontend.json")))
    readers += [(lambda path, shape=shape: serve_rows(path, shape, hardware), path)
                for shape, path in shapes(args.out_dir, "serve", ".json")]
    readers += [(lambda path, name=name: profile_rows(path, name), os.path.join(args.out_dir, name + ".txt"))
                for name in ("profile", "profile-sync", "profile-llama-3.1-8b", "profile-llama-3.1-8b-flash")]
    readers.append((tokenizing_rows, os.path.join(args.out_dir, "tokenizing.txt")))
    readers.append((attention_rows, os.path.join(args.out_dir, "attention.json")))
    rows = end_to_end_rows(args.out_dir)
    for reader, path in readers:
        try:
            rows += reader(path)
        except Exception as exc:  # a half-written file must not hide the other figures
            rows.append((os.path.basename(path), f"unreadable: {exc}", ""))
    print(f"\n{'figure':<48}{'value':>16}  target  (roofline: {args.bandwidth_tbps:g} TB/s, {args.peak_tflops:g} TFLOP/s)")
    for figure, value, target in rows:
        print(f"{figure:<48}{value:>16}  {target}")


if __name__ == "__main__":
    main()
