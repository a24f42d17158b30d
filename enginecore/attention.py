"""The engine's paged attention, plugged into any transformers model that uses the AttentionInterface.

The model runner flattens a whole step (every sequence's new tokens) into one sequence of batch size 1 with
explicit position ids, so the model's own code (embeddings, RoPE, MLPs) runs unchanged on the packed batch.
Only attention needs to know where one sequence ends and the next begins: it gets that from the StepAttention
the runner installs for the forward pass. Per layer it
  1. writes the new tokens' K/V into the paged cache (one index_copy_ per tensor, through the slot mapping);
  2. attends: the single-token sequences (decodes) as one batched SDPA over their gathered blocks with a length
     mask; each longer run (a prompt or a chunk of one) on its own, causally, over its cached context.

transformers builds no mask for an implementation it has no mask function for (masking_utils returns early), which
is what we want: a mask over the packed batch would be wrong and large. We deliberately register no mask
function: one that returns None would still make transformers inspect the position ids every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

ATTENTION_NAME = "supervise_paged"


@dataclass
class PrefillRun:
    """A run of >1 new tokens of one sequence: rows [start, end) of the packed batch."""

    start: int
    end: int
    # None when the run starts the sequence (nothing cached yet): plain causal attention over the new K/V.
    context_blocks: torch.Tensor | None = None  # block ids covering the whole context
    context_len: int = 0
    mask: torch.Tensor | None = None  # [run length, context_len] bool: True where a query may look


@dataclass
class VarlenAttention:
    """The whole step as one variable-length flash-attention call (CUDA, half precision): every sequence's new
    tokens (one for a decode) against its whole context, gathered from the cache through kv_slots."""

    kv_slots: torch.Tensor  # [total context] the cache slots of every run's context, run after run
    cu_q: torch.Tensor  # [runs + 1] int32 cumulative query lengths
    cu_k: torch.Tensor  # [runs + 1] int32 cumulative context lengths
    max_q: int
    max_k: int


@dataclass
class StepAttention:
    """Everything attention needs about the packed batch of one step; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    num_decodes: int  # the first num_decodes rows are single-token sequences
    decode_blocks: torch.Tensor | None = None  # [num_decodes * blocks per sequence] block tables padded with 0
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, blocks * block_size] bool: True = attend
    prefills: list[PrefillRun] = field(default_factory=list)
    varlen: VarlenAttention | None = None  # set instead of the rest where flash varlen attention runs


class _Current:
    """The step being computed and the cache it uses (one forward pass at a time per process)."""

    step: StepAttention | None = None
    kv_cache = None  # enginecore.kv_cache.KVCache


current = _Current()


def paged_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query [1, heads, T, d]; key/value [1, kv_heads, T, d] -> ([1, T, heads, d], None), as transformers expects."""
    step = current.step
    layer = module.layer_idx
    k_slots, v_slots = current.kv_cache.slots[layer]
    k_new = key[0].transpose(0, 1)  # [T, kv_heads, d]
    v_new = value[0].transpose(0, 1)
    k_slots.index_copy_(0, step.slot_mapping, k_new)
    v_slots.index_copy_(0, step.slot_mapping, v_new)

    _, heads, num_tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if step.varlen is not None:
        return _varlen(layer, query, step.varlen, scaling), None
    if not step.prefills:  # all decodes: one batched op, no copy into a separate output
        return _decode(layer, query[0], step, kv_heads, group, scaling).unsqueeze(0), None

    out = query.new_empty(num_tokens, heads, head_dim)
    b = step.num_decodes
    if b:
        out[:b] = _decode(layer, query[0, :, :b], step, kv_heads, group, scaling)
    for run in step.prefills:
        q = query[:, :, run.start:run.end]
        if run.context_blocks is None:
            k = key[:, :, run.start:run.end]
            v = value[:, :, run.start:run.end]
            o = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=group > 1)
        else:
            k, v = _gather(current.kv_cache.layers[layer], run.context_blocks, run.context_len)
            o = sdpa(q, k, v, attn_mask=run.mask, scale=scaling, enable_gqa=group > 1)
        out[run.start:run.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _varlen(layer: int, query: torch.Tensor, v: VarlenAttention, scaling) -> torch.Tensor:
    """Causal attention aligned to the end of each sequence's context (bottom right): right for a decode, a
    fresh prompt and a chunk after cached tokens alike."""
    k_slots, v_slots = current.kv_cache.slots[layer]
    q = query[0].transpose(0, 1).contiguous()  # [tokens, heads, d]
    out = flash_varlen(q, k_slots.index_select(0, v.kv_slots), v_slots.index_select(0, v.kv_slots),
                       v.cu_q, v.cu_k, v.max_q, v.max_k, scaling)
    return out.unsqueeze(0)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling) -> torch.Tensor:
    """[total_q, heads, d] -> [total_q, heads, d]; k/v [total_k, kv_heads, d] (flash attention handles GQA)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scaling)[0]


def flash_varlen_works(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether this torch build runs variable-length flash attention here (CUDA, half precision, its head sizes),
    checked once against plain SDPA."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(5, heads, head_dim, device=device, dtype=dtype, generator=g)
        kv = torch.randn(2, 7, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
        cu_q = torch.tensor([0, 2, 5], device=device, dtype=torch.int32)
        cu_k = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
        got = flash_varlen(q, kv[0], kv[1], cu_q, cu_k, 3, 4, head_dim ** -0.5)
        # The second run: 3 queries at positions 1..3 of a 4-token context.
        ref = sdpa(q[None, 2:5].transpose(1, 2), kv[0, None, 3:7].transpose(1, 2), kv[1, None, 3:7].transpose(1, 2),
                   attn_mask=torch.ones(3, 4, dtype=torch.bool, device=device).tril(1), enable_gqa=heads != kv_heads)
        return torch.allclose(got[2:5], ref[0].transpose(0, 1), atol=2e-2, rtol=2e-2)
    except Exception:  # no flash kernel in this build or for these shapes
        return False


def _gather(layer_kv: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context K and V, each [1, kv_heads, length, d]."""
    kv = layer_kv.index_select(1, block_ids).flatten(1, 2)[:, :length]  # [2, length, kv_heads, d]
    kv = kv.transpose(1, 2).unsqueeze(1)
    return kv[0], kv[1]


def _decode(layer: int, q: torch.Tensor, step: StepAttention, kv_heads: int, group: int, scaling) -> torch.Tensor:
    """q [heads, B, d] -> [B, heads, d]. Each query head attends with the other heads of its KV group, packed as
    the 'query length' dimension of SDPA, so no K/V is repeated per head."""
    heads, b, d = q.shape
    # K and V of every decode's blocks in one index_select (much cheaper than advanced indexing on the CPU).
    kv = current.kv_cache.layers[layer].index_select(1, step.decode_blocks)  # [2, B * blocks, block, kv_heads, d]
    kv = kv.view(2, b, -1, kv_heads, d).transpose(2, 3)  # [2, B, kv_heads, L, d]
    q = q.transpose(0, 1).reshape(b, kv_heads, group, d)
    o = sdpa(q, kv[0], kv[1], attn_mask=step.decode_mask, scale=scaling)  # [B, kv_heads, group, d]
    return o.reshape(b, heads, d)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
