"""Paged attention in Triton: a flash varlen step (enginecore.attention.VarlenAttention) computed with K/V read
from the cache blocks where they lie. Imported only where Triton is (CUDA; the tests run it on the CPU through
Triton's interpreter).

Why: gather + flash reads every context's K/V from the cache, writes it into one contiguous buffer per layer and
reads it again (three passes over the step's largest data after the weights), and pads each context to whole
blocks. At 256 sequences of Llama-3.1-8B the gather, slot by slot then, was 21% of a decode step's GPU time; by
whole blocks it is faster, but still two of the three passes. Here each program reads its sequence's blocks
through the block table, once.

One kernel serves decodes and prompt chunks alike. A program takes one run (a sequence's new tokens), one KV head
and a tile of rows, where a row is one (query, head of that KV head's group) pair: GQA heads share every K/V load,
and a decode's `group` heads fill one tile. Causal aligned bottom right: query j of a run of n new tokens with
`used` keys sees keys 0 .. used - n + j. Decode-only steps with too few (run, KV head) pairs to fill the GPU split
each context into `splits` ranges (flash decoding); a second kernel merges the ranges' partial softmaxes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.language as tl

# (rows per tile, keys per iteration, warps, pipeline stages). Decode-only steps: a tile is one query's group of
# heads, padded to tl.dot's minimum of 16 rows; which of these runs fastest depends on the GPU and the head size,
# so enginecore.attention_plan times each at start-up (the first is the default). Steps with prompt tokens: one.
DECODE_TILES = ((16, 64, 4, 2), (16, 32, 4, 2), (16, 128, 8, 3))
MIXED_TILE = (64, 64, 8, 2)
# A split covers at least this many keys: below it, merging costs more than the parallelism gains.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 32

# The metadata tensors may be views at any offset (a CUDA graph's static buffers): no alignment specialization,
# and no specialization on the query strides (transformers' own forward hands a view whose strides grow with the
# step's tokens), so one compiled kernel serves every step and none is compiled while a graph is captured.
_UNALIGNED = ["q_ptr", "kv_blocks_ptr", "cu_q_ptr", "cu_k_ptr", "seqused_k_ptr"]


@triton.jit(do_not_specialize=["splits", "num_runs", "stride_qt", "stride_qh"],
            do_not_specialize_on_alignment=_UNALIGNED)
def _attend(out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_ptr, v_ptr, kv_blocks_ptr, cu_q_ptr, cu_k_ptr,
            seqused_k_ptr, scale_log2, splits, num_runs,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIND_RUN: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    queries_per_tile: tl.constexpr = BLOCK_M // GROUP
    if FIND_RUN:
        # Run i owns tiles cu_q[i] // queries_per_tile + i up to cu_q[i + 1] // queries_per_tile + i, at least as
        # many as its queries fill (as vLLM's unified Triton attention lays them out): the grid is tokens /
        # queries_per_tile + runs, not runs x the longest run's tiles. Binary search for the last run that starts
        # at or before this tile.
        lo = num_runs * 0
        hi = num_runs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            starts_before = tl.load(cu_q_ptr + mid) // queries_per_tile + mid <= tile
            lo = tl.where(starts_before, mid, lo)
            hi = tl.where(starts_before, hi, mid - 1)
        run = lo
        q_start = tl.load(cu_q_ptr + run)
        first_q = (tile - q_start // queries_per_tile - run) * queries_per_tile
    else:  # a decode per run: one tile each
        run = tile
        q_start = tl.load(cu_q_ptr + run)
        first_q = 0
    q_len = tl.load(cu_q_ptr + run + 1) - q_start
    if first_q < q_len:
        used = tl.load(seqused_k_ptr + run)
        first_block = tl.load(cu_k_ptr + run) // BLOCK_SIZE
        rows = tl.arange(0, BLOCK_M)
        query = first_q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < queries_per_tile * GROUP) & (query < q_len)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        position = used - q_len + query  # the row's query sees keys 0 .. position
        # Keys this tile's last query sees, and this split's share of them (whole iterations each).
        last_q = tl.minimum(first_q + queries_per_tile, q_len) - 1
        end = used - q_len + last_q + 1
        per_split = tl.cdiv(tl.cdiv(end, splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, end)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            block = tl.load(kv_blocks_ptr + first_block + keys // BLOCK_SIZE, mask=key_ok, other=0)
            at = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where((keys[None, :] <= position[:, None]) & key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m - m_safe)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        token = q_start + query
        if splits == 1:
            o = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:  # partial results of this split, [tokens, heads, splits, ...]; _merge finishes them
            part = (token * tl.num_programs(1) * GROUP + head) * splits + split
            tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, total, mask=row_ok)


@triton.jit(do_not_specialize=["splits"])
def _merge(out_ptr, part_acc_ptr, part_ml_ptr, splits, stride_ot, stride_oh,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (token, head): the splits' partial softmaxes into one. A split that saw no key has m = -inf and a
    total of 0."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * splits + tl.arange(0, BLOCK_S)
    split_ok = tl.arange(0, BLOCK_S) < splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    total = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=split_ok[:, None], other=0.0)
    top = tl.max(m, 0)  # finite: split 0 always sees key 0
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - top))
    o = tl.sum(acc * w[:, None], 0) / tl.sum(total * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_varlen(q: torch.Tensor, layer_kv: torch.Tensor, kv_blocks: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, seqused_k: torch.Tensor, max_q: int, max_k: int, scaling: float,
                 decode_tile: tuple[int, int, int, int] = DECODE_TILES[0]) -> torch.Tensor:
    """What attention.flash_varlen computes over K/V gathered by whole blocks, read from the cache instead.

    q [tokens, heads, d] (any strides with unit last stride); layer_kv [2, blocks, block_size, kv_heads, d], one
    layer of the cache; the rest as VarlenAttention holds them (max_q and max_k bound the step: they size the
    grid and the splits, so a CUDA graph's values hold for every step replayed into it)."""
    out, steps = launches(q, layer_kv, kv_blocks, cu_q, cu_k, seqused_k, max_q, max_k, scaling, decode_tile)
    for launch in steps:
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    return out


@dataclass
class Launch:
    kernel: Any  # a triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # constexprs, num_warps, num_stages


def launches(q: torch.Tensor, layer_kv: torch.Tensor, kv_blocks: torch.Tensor, cu_q: torch.Tensor,
             cu_k: torch.Tensor, seqused_k: torch.Tensor, max_q: int, max_k: int, scaling: float,
             decode_tile: tuple[int, int, int, int]) -> tuple[torch.Tensor, list[Launch]]:
    """paged_varlen's output tensor and the kernel launches that fill it (tests compile them for GPUs as they
    are launched)."""
    tokens, heads, head_dim = q.shape
    k, v = layer_kv[0], layer_kv[1]
    _, block_size, kv_heads, _ = k.shape
    if q.stride(2) != 1 or k.stride(3) != 1:
        raise ValueError("paged attention needs unit stride over the head dimension")
    group = heads // kv_heads
    runs = seqused_k.shape[0]
    out = q.new_empty(tokens, heads, head_dim)
    decodes = max_q == 1
    block_m, block_n, warps, stages = decode_tile if decodes else MIXED_TILE
    block_m = max(block_m, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = runs if decodes else tokens // (block_m // group) + runs
    splits = decode_splits(runs, kv_heads, max_k, _multiprocessors(q.device)) if decodes else 1
    if splits > 1:
        part_acc = torch.empty(tokens * heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tokens * heads * splits * 2, dtype=torch.float32, device=q.device)
    else:  # not written; float32 all the same, so every call runs the one compiled kernel
        part_acc = part_ml = torch.empty(1, dtype=torch.float32, device=q.device)
    steps = [Launch(_attend, (tiles, kv_heads, splits),
                    (out, part_acc, part_ml, q, k, v, kv_blocks, cu_q, cu_k, seqused_k, scaling * 1.4426950408889634,
                     splits, runs, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1),
                     k.stride(2)),
                    dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_M=block_m,
                         BLOCK_N=block_n, FIND_RUN=not decodes, num_warps=warps, num_stages=stages))]
    if splits > 1:
        steps.append(Launch(_merge, (tokens, heads), (out, part_acc, part_ml, splits, out.stride(0), out.stride(1)),
                            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
                                 num_warps=4)))
    return out, steps


def decode_splits(runs: int, kv_heads: int, max_k: int, multiprocessors: int) -> int:
    """Key ranges per decode: enough programs for two per multiprocessor, each range at least MIN_SPLIT_KEYS."""
    programs = runs * kv_heads
    if programs >= 2 * multiprocessors:
        return 1
    wanted = -(-2 * multiprocessors // programs)
    return max(1, min(wanted, max_k // MIN_SPLIT_KEYS, MAX_SPLITS))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter on the CPU (tests): any count that makes small steps split
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_with(decode_tile: tuple[int, int, int, int]) -> Callable:
    """paged_varlen as an attention.VarlenKernel (`step` is the step's VarlenAttention), with this decode tile."""

    def paged(q: torch.Tensor, layer_kv: torch.Tensor, step, scaling: float) -> torch.Tensor:
        return paged_varlen(q, layer_kv, step.kv_blocks, step.cu_q, step.cu_k, step.seqused_k, step.max_q,
                            step.max_k, scaling, decode_tile)

    paged.decode_tile = decode_tile  # type: ignore[attr-defined]
    return paged


def tile_name(decode_tile: tuple[int, int, int, int]) -> str:
    _, keys, warps, stages = decode_tile
    return f"{keys} keys x {warps} warps x {stages} stages"


paged = paged_with(DECODE_TILES[0])
