"""One layer's attention of an engine step, by each kernel of varlen steps: gather + flash (torch's flash varlen
kernel over every context gathered from the cache) against paged Triton (enginecore.paged_triton, which reads the
cache blocks where they lie), on each model shape's heads, for decode-only steps and a step with a prompt chunk.

Each row: microseconds a layer by each kernel (the paged kernel with its default decode tile, and on decode rows its
fastest tile, as the engine's start-up choice would take it), the paged kernel's speed-up (its best), and the
bandwidth at which it reads the step's K/V (the bytes it must read, over its time) as a share of the GPU's
(--bandwidth-tbps). After them, per shape, a layer's RoPE and K/V cache write for 256 tokens: the lean forward's
torch ops against enginecore.rope_triton's one kernel. The targets: paged at
least as fast as gather + flash on every decode row (steps with prompt tokens are shown, not targeted: the engine
times both kernels at start-up and keeps flash where it wins), and >= 50% of the bandwidth on the decode rows of
256 sequences (the rows an engine at full load runs); the verdict lines say whether each holds.

    python3 bench/attention.py                   # CUDA, bfloat16, the three shapes of bench/device.sh
    .venv/bin/python bench/attention.py --cpu    # Triton's interpreter on tiny steps: a smoke test of the script
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"smollm2-135m": ".device/smollm2", "llama-3.2-1b": "bench/models/llama-3.2-1b",
          "llama-3.1-8b": "bench/models/llama-3.1-8b"}
# (name, runs as (new tokens, context)): the engine bench's decode (contexts 128-256), longer chats, one long
# context (the paged kernel splits its keys), and a prompt chunk beside decodes.
STEPS_GPU = [
    ("decode 256 x 128-256", [(1, c) for c in random.Random(0).choices(range(129, 257), k=256)]),
    ("decode 256 x 1024-2048", [(1, c) for c in random.Random(1).choices(range(1024, 2049), k=256)]),
    ("decode 16 x 2048", [(1, 2048)] * 16),
    ("decode 1 x 8192", [(1, 8192)]),
    ("chunk 512 after 512 + 63 decodes", [(1, c) for c in random.Random(2).choices(range(129, 257), k=63)]
     + [(512, 1024)]),
]
STEPS_CPU = [("decode 4 x 40-90", [(1, 40), (1, 90), (1, 64), (1, 17)]), ("chunk 20 after 30 + 2 decodes",
                                                                          [(1, 33), (1, 5), (20, 50)])]
TARGET_BANDWIDTH = 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--bandwidth-tbps", type=float, default=4.8, help="the GPU's memory bandwidth (H200: 4.8)")
    p.add_argument("--cpu", action="store_true", help="Triton's interpreter on tiny steps (a smoke test)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    if args.cpu:  # Triton's interpreter, chosen before triton is imported, with the tests' fix for it
        from tests import triton_setup  # noqa: F401
    import torch

    from enginecore import attention_plan

    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float16 if args.cpu else torch.bfloat16  # the interpreter multiplies bfloat16 wrongly
    rows = []
    from enginecore import paged_triton

    print(f"{'shape':14} {'step':34} {'flash us':>9} {'paged us':>9} {'best tile us':>13} {'speed-up':>8} "
          f"{'paged TB/s':>10} {'of peak':>7}  best tile")
    for name in args.shapes:
        heads, kv_heads, head_dim = _heads(SHAPES[name])
        kernels = {}
        for kernel in ("flash", "triton"):
            fn, why_not = attention_plan.kernel_named(kernel)
            why_not = why_not or attention_plan.kernel_fails(fn, device, dtype, heads, kv_heads, head_dim)
            if why_not is None:
                kernels[kernel] = fn
            else:
                print(f"{name}: {attention_plan.NAMES[kernel]} does not run here: {why_not}")
        for step, runs in (STEPS_CPU if args.cpu else STEPS_GPU):
            case = attention_plan.make_case(runs, device, dtype, heads, kv_heads, head_dim,
                                            torch.Generator(device=device).manual_seed(0))
            times = {k: _time(fn, case) for k, fn in kernels.items()}
            kv_bytes = sum(c for _, c in runs) * 2 * kv_heads * head_dim * case.layer_kv.element_size()
            row = {"shape": name, "step": step, "flash_us": _us(times.get("flash")), "paged_us": _us(times.get("triton")),
                   "kv_bytes": kv_bytes}
            if "triton" in times:
                if case.step.max_q == 1:  # the decode tiles, as the engine's start-up choice tries them
                    tiles = {paged_triton.DECODE_TILES[0]: times["triton"]}
                    tiles.update({tile: _time(paged_triton.paged_with(tile), case)
                                  for tile in paged_triton.DECODE_TILES[1:]})
                else:  # steps with prompt tokens have one tile
                    tiles = {paged_triton.MIXED_TILE: times["triton"]}
                best = min(tiles, key=lambda tile: tiles[tile])
                row["best_tile"], row["best_tile_us"] = paged_triton.tile_name(best), tiles[best] * 1e6
                row["paged_tbps"] = kv_bytes / tiles[best] / 1e12
                row["of_peak"] = row["paged_tbps"] / args.bandwidth_tbps
                if "flash" in times:
                    row["speedup"] = times["flash"] / tiles[best]
            rows.append(row)
            print(f"{name:14} {step:34} {_cell(row['flash_us'], 9, '.1f')} {_cell(row['paged_us'], 9, '.1f')} "
                  f"{_cell(row.get('best_tile_us'), 13, '.1f')} {_cell(row.get('speedup'), 8, '.2f')} "
                  f"{_cell(row.get('paged_tbps'), 10, '.2f')} {_cell(row.get('of_peak'), 7, '.0%')}  "
                  f"{row.get('best_tile', '-')}")
    _verdict(rows)
    rope_rows = [_rope_row(name, *_heads(SHAPES[name]), device, dtype) for name in args.shapes]
    print(f"\n{'shape':14} {'RoPE + K/V write, 256 tokens':34} {'torch us':>9} {'fused us':>9} {'speed-up':>8}")
    for row in rope_rows:
        print(f"{row['shape']:14} {'':34} {_cell(row.get('torch_us'), 9, '.1f')} {_cell(row.get('fused_us'), 9, '.1f')} "
              f"{_cell(row.get('speedup'), 8, '.2f')}  {row.get('error', '')}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"attention": rows, "rope": rope_rows}, f, indent=1)


def _rope_row(shape: str, heads: int, kv_heads: int, head_dim: int, device, dtype) -> dict:
    """A layer's RoPE and K/V cache write for 256 tokens: the lean forward's torch ops (four for RoPE, two cache
    copies) against enginecore.rope_triton's one kernel."""
    import torch

    from enginecore import attention_plan, rope_triton

    why_not = attention_plan.rope_store_fails(device, dtype, heads, kv_heads, head_dim)
    if why_not is not None:
        return {"shape": shape, "error": f"the fused kernel does not run here: {why_not}"}
    g = torch.Generator(device=device).manual_seed(0)
    tokens = 256
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, generator=g)
    cos = torch.randn(tokens, 1, head_dim, device=device, dtype=dtype, generator=g)
    sin = torch.randn(tokens, 1, head_dim, device=device, dtype=dtype, generator=g)
    slots = torch.randperm(4 * tokens, device=device, generator=g)[:tokens]
    k, v = (torch.zeros(4 * tokens, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
    args = (qkv, cos, sin, slots, k, v, heads, kv_heads)
    times = {name: _time_call(lambda fn=fn: fn(*args), device)
             for name, fn in (("torch", rope_triton.reference), ("fused", rope_triton.rope_store))}
    return {"shape": shape, "torch_us": times["torch"] * 1e6, "fused_us": times["fused"] * 1e6,
            "speedup": times["torch"] / times["fused"]}


def _time_call(call, device) -> float:
    """Seconds a call: CUDA graph replays on the GPU (attention_plan.time_calls), the wall clock on the CPU."""
    from enginecore import attention_plan

    if device.type == "cuda":
        return attention_plan.time_calls(call, device) / 1e3
    call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _heads(model_dir: str) -> tuple[int, int, int]:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads


def _time(kernel, case) -> float:
    """Seconds a call of an attention kernel on `case` (_time_call)."""
    return _time_call(lambda: kernel(case.q, case.layer_kv, case.step, case.scaling), case.q.device)


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _cell(value, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _verdict(rows: list[dict]) -> None:
    compared = [r for r in rows if "speedup" in r and r["step"].startswith("decode")]
    full = [r for r in rows if r["step"].startswith("decode 256") and "of_peak" in r]
    if compared:
        slowest = min(compared, key=lambda r: r["speedup"])
        print(f"paged vs gather + flash on decodes: {min(r['speedup'] for r in compared):.2f}x at worst ({slowest['shape']}, "
              f"{slowest['step']}), {max(r['speedup'] for r in compared):.2f}x at best; target >= 1.00x: "
              f"{'met' if slowest['speedup'] >= 1 else 'NOT met'}")
    if full:
        worst = min(r["of_peak"] for r in full)
        print(f"paged on decodes of 256 sequences: >= {worst:.0%} of the bandwidth; target >= {TARGET_BANDWIDTH:.0%}: "
              f"{'met' if worst >= TARGET_BANDWIDTH else 'NOT met'}")


if __name__ == "__main__":
    main()
