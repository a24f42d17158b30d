"""Our CPU kernels (enginecore/csrc: decode_attention.c, layer_ops.c) against the torch ops they stand in for, on
SmolLM2-135M's shapes (9 heads, 3 KV heads of 64; hidden 576, intermediate 1536), float32, microseconds a call
(best of 10 rounds of the mean of --number calls), each through the engine's own Python wrapper:

- decode attention of R rows of L tokens (random blocks of 16 in a pool): torch's path (the blocks gathered by two
  index_selects, padded to the longest row with a mask, SDPA) against ours, which reads them where they lie;
- RMS norm, SiLU(gate) x up, and RoPE with the K/V cache write, at 1 and 32 rows;
- a weight made into int8_linear.c's 8-bit codes (csrc/int8_codes.h, at every start of an int8 engine) against
  the same steps in torch's tensor operations (tests/test_cpu_int8.py's reference), in millions of weights a
  second: random weights (on no grid) and a GGUF Q4_1-like one (every block tried on the grids, the step fitted).

    .venv/bin/python bench/cpu_kernels.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: E402

from enginecore import cpu_attention  # noqa: E402
from enginecore.cpu_int8 import block_codes, packed_int8_unavailable_reason  # noqa: E402
from enginecore.cpu_layer_ops import layer_ops  # noqa: E402
from enginecore.lean_model import rope  # noqa: E402
from tests.test_cpu_int8 import gguf_like, reference_block_codes  # noqa: E402

HEADS, KV_HEADS, D, BLOCK = 9, 3, 64, 16
HIDDEN, INTERMEDIATE = 576, 1536
ATTENTION_CASES = [(1, 64), (1, 1024), (8, 256), (32, 64), (32, 400), (32, 1000)]  # (rows, context tokens each)


def best_us(call, number: int) -> float:
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, (time.perf_counter() - started) / number)
    return best * 1e6


def attention_cases(number: int) -> None:
    lib = cpu_attention.kernel()
    print(f"decode attention, one layer ({HEADS} heads, {KV_HEADS} KV heads of {D}, blocks of {BLOCK}), us a call")
    for rows, length in ATTENTION_CASES:
        per_row = -(-length // BLOCK)
        layer = torch.randn(2, rows * per_row + 1, BLOCK, KV_HEADS, D)
        tables = torch.randperm(rows * per_row)
        lengths = torch.full((rows,), length, dtype=torch.int64)
        mask = (torch.arange(per_row * BLOCK)[None, :] < lengths[:, None])[:, None, None, :]
        q = torch.randn(rows, HEADS, D)
        kv = (layer[0].data_ptr(), layer[1].data_ptr(), BLOCK, KV_HEADS)

        def torch_path():
            k, v = layer[0].index_select(0, tables).flatten(0, 1), layer[1].index_select(0, tables).flatten(0, 1)
            k, v = (t.view(rows, -1, KV_HEADS, D).transpose(1, 2) for t in (k, v))
            return sdpa(q.reshape(rows, KV_HEADS, HEADS // KV_HEADS, D), k, v, attn_mask=mask, scale=0.125)

        def ours():
            return cpu_attention.decode(q, kv, tables, lengths, 0.125, lib)

        error = (ours() - torch_path().reshape(rows, HEADS, D)).abs().max().item()
        t, o = best_us(torch_path, number), best_us(ours, number)
        print(f"  {rows:>3} rows x {length:>5} tokens: torch {t:9.1f}  ours {o:9.1f}  ({t / o:.2f}x; "
              f"largest difference {error:.1e})")


def layer_op_cases(number: int) -> None:
    ops = layer_ops()
    print("a layer's small ops, us a call")
    for rows in (1, 32):
        h = torch.randn(rows, HIDDEN)
        w = torch.randn(HIDDEN)
        gate_up = torch.randn(rows, 2 * INTERMEDIATE)
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * D)
        angles = torch.rand(rows, D // 2)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
        slots = torch.arange(rows)
        k_slots, v_slots = torch.zeros(rows, KV_HEADS, D), torch.zeros(rows, KV_HEADS, D)

        def torch_rope():
            qk = rope(qkv[:, :(HEADS + KV_HEADS) * D].view(rows, HEADS + KV_HEADS, D), cos[:, None], sin[:, None])
            k_slots.index_copy_(0, slots, qk[:, HEADS:])
            v_slots.index_copy_(0, slots, qkv[:, (HEADS + KV_HEADS) * D:].view(rows, KV_HEADS, D))
            return qk[:, :HEADS]

        cases = {
            "RMS norm": (lambda: torch.rms_norm(h, (HIDDEN,), w, 1e-5), lambda: ops.rms_norm(h, w, 1e-5)),
            "SiLU x up": (lambda: torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]).mul_(gate_up[:, INTERMEDIATE:]),
                          lambda: ops.silu_mul(gate_up)),
            "RoPE + K/V write": (torch_rope,
                                 lambda: ops.rope_store(qkv, cos, sin, slots, k_slots, v_slots, HEADS, KV_HEADS)),
        }
        for name, (theirs, ours) in cases.items():
            t, o = best_us(theirs, number), best_us(ours, number)
            print(f"  {rows:>3} rows, {name:<17} torch {t:7.1f}  ours {o:7.1f}  ({t / o:.2f}x)")


def codes_cases() -> None:
    """Millions of weights a second, best of 3, on a 2,048 x 8,192 weight (a 1B model's product is 2,048 x 8,192)."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 2048, 8192
    for name, weight in (("random", torch.randn(rows, cols, generator=gen) * 0.05),
                         ("Q4_1-like", gguf_like(rows, cols, 16, False, gen))):
        t, o = (rows * cols / best_us(lambda: make(weight), 1) for make in (reference_block_codes, block_codes))
        print(f"  int8 codes, {name:<10} torch {t:7.1f}  ours {o:7.1f}  M weights/s  ({o / t:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--number", type=int, default=50, help="calls per timed round")
    args = p.parse_args()
    if cpu_attention.kernel() is None or layer_ops() is None:
        sys.exit("our CPU kernels cannot be built here (no C compiler): nothing to compare")
    print(f"threads: {torch.get_num_threads()}")
    attention_cases(args.number)
    layer_op_cases(args.number)
    if packed_int8_unavailable_reason() is None:
        codes_cases()


if __name__ == "__main__":
    main()
