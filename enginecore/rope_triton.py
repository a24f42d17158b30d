"""RoPE and the K/V cache write of a layer in one Triton kernel (CUDA, where the lean forward's steps attend in
one varlen call). Imported only where Triton is (the tests run it on the CPU through Triton's interpreter).

Why: the lean forward rotates q and k in four elementwise ops (two products, a roll, a sum) and attention then
copies k and v into the cache in two more: six kernels a layer over the same few megabytes, in a decode step where
the small kernels cost about as much as the products (SmolLM2-135M at 256 sequences on the H200). Here one program
per token reads the token's q/k/v row once, rotates q and k, writes q for attention and k and v into the token's
cache slot.

Exactly the lean forward's values: each product is rounded to the model's dtype before the sum, as the separate
ops round them, so the outputs are bit for bit the same (attention_plan.rope_store_fails checks that at start-up).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from enginecore.lean_model import rope
from enginecore.paged_triton import Launch


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _rope_store(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                stride_qkv, stride_cos, stride_sin, stride_q, stride_slot,
                HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.arange(0, BLOCK_H)  # q heads, then k heads, then v heads
    dims = tl.arange(0, BLOCK_D)
    ok = (head < HEADS + 2 * KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    row = qkv_ptr + token * stride_qkv + head[:, None] * HEAD_DIM
    x = tl.load(row + dims[None, :], mask=ok, other=0.0)
    # x rolled by half a head (dims + half, modulo the head: the same as rolling back by half)
    rolled = tl.load(row + ((dims + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=ok, other=0.0)
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < HEAD_DIM, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < HEAD_DIM, other=0.0)
    dtype = x.dtype
    a = (x * cos[None, :]).to(dtype)  # rounded as the lean forward's own product is
    b = (rolled * sin[None, :]).to(dtype)
    rotated = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    out = tl.where((head < HEADS + KV_HEADS)[:, None], rotated, x)  # v is not rotated
    at = head[:, None] * HEAD_DIM + dims[None, :]
    tl.store(q_ptr + token * stride_q + at, out, mask=ok & (head < HEADS)[:, None])
    slot = tl.load(slots_ptr + token).to(tl.int64)
    is_k = (head >= HEADS) & (head < HEADS + KV_HEADS)
    tl.store(k_cache_ptr + slot * stride_slot + at - HEADS * HEAD_DIM, out, mask=ok & is_k[:, None])
    tl.store(v_cache_ptr + slot * stride_slot + at - (HEADS + KV_HEADS) * HEAD_DIM, out,
             mask=ok & (head >= HEADS + KV_HEADS)[:, None])


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
               k_slots: torch.Tensor, v_slots: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) d] (one product's rows); cos, sin_signed [T, 1, d] (lean_model's tables);
    slots [T] each token's cache slot; k_slots, v_slots [slots, kv_heads, d] one layer's cache. Writes the rotated
    k and v into the cache; returns the rotated q [T, heads, d]."""
    q, launch = rope_launch(qkv, cos, sin_signed, slots, k_slots, v_slots, heads, kv_heads)
    launch.kernel[launch.grid](*launch.args, **launch.meta)
    return q


def rope_launch(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                k_slots: torch.Tensor, v_slots: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, Launch]:
    """rope_store's output tensor and its launch (tests compile it for GPUs as it is launched)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or sin_signed.stride(-1) != 1 or k_slots.stride()[1:] != (
            head_dim, 1) or v_slots.stride() != k_slots.stride():
        raise ValueError("rope_store needs rows of q/k/v, tables and cache slots laid out contiguously")
    q = qkv.new_empty(tokens, heads, head_dim)
    return q, Launch(_rope_store, (tokens,),
                     (qkv, cos, sin_signed, slots, q, k_slots, v_slots, qkv.stride(0), cos.stride(0),
                      sin_signed.stride(0), q.stride(0), k_slots.stride(0)),
                     dict(HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                          BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads),
                          BLOCK_D=triton.next_power_of_2(head_dim)))


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
              k_slots: torch.Tensor, v_slots: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """What the lean forward and attention do instead: the same results with torch's ops."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    qk = rope(qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim), cos, sin_signed)
    k_slots.index_copy_(0, slots, qk[:, heads:])
    v_slots.index_copy_(0, slots, qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim))
    return qk[:, :heads]
