"""How fast one layer's K and V come out of the paged cache for a decode step: the engine's gather
(enginecore.attention._gather_blocks: one index_select over the blocks' own dimension for K, one for V) against one
index_select over dimension 1 of the layer's [2, blocks, ...] tensor (what the CPU decode path did before), with
SmolLM2-135M's K/V shape (3 heads of 64) in float32, random block ids in a pool of 4,096 blocks of 16 tokens.

    .venv/bin/python bench/kv_gather.py
    .venv/bin/python bench/kv_gather.py --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from enginecore.attention import _gather_blocks  # noqa: E402

CASES = [(1, 128), (8, 128), (8, 512), (32, 256)]  # (decodes, context tokens each)


def _us(call, device: str, number: int = 200) -> float:
    for _ in range(20):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(number):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    block, kv_heads, head_dim, pool = 16, 3, 64, 4096
    layer = torch.randn(2, pool, block, kv_heads, head_dim).to(args.device, dtype)
    print(f"{args.device} {args.dtype}, {torch.get_num_threads()} threads: one layer's K and V, microseconds")
    for decodes, context in CASES:
        ids = torch.randint(0, pool, (decodes * (context // block),), device=args.device)
        dim0 = _us(lambda: _gather_blocks(layer, ids), args.device)
        dim1 = _us(lambda: layer.index_select(1, ids), args.device)
        print(f"  {decodes:>2} decodes x {context:>3} tokens: engine (dim 0, K and V apart) {dim0:7.1f}   "
              f"dim 1 in one call {dim1:7.1f}   {dim1 / dim0:.1f}x")


if __name__ == "__main__":
    main()
