"""The engine's paged attention, plugged into any transformers model that uses the AttentionInterface.

The model runner flattens a whole step (every sequence's new tokens) into one sequence of batch size 1 with
explicit position ids, so the model's own code (embeddings, RoPE, MLPs) runs unchanged on the packed batch.
Only attention needs to know where one sequence ends and the next begins: it gets that from the StepAttention
the runner installs for the forward pass. Per layer it
  1. writes the new tokens' K/V into the paged cache (one index_copy_ per tensor, through the slot mapping);
  2. attends: the single-token sequences (decodes) as one batched SDPA over their gathered blocks with a length
     mask; each longer run (a prompt or a chunk of one) on its own, causally, over its cached context. On CUDA in
     half precision the whole step is one variable-length call instead (VarlenAttention), by one of two kernels
     (VarlenKernels, chosen at start-up per kind of step by enginecore.attention_plan): flash attention's, over every
     run's context gathered by whole blocks (padded to a whole number of them) with its real length in seqused_k,
     or enginecore.paged_triton's, which reads the blocks where they lie.

transformers builds no mask for an implementation it has no mask function for (masking_utils returns early), which
is what we want: a mask over the packed batch would be wrong and large. We deliberately register no mask
function: one that returns None would still make transformers inspect the position ids every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from enginecore import cpu_attention

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
    tokens (one for a decode) against its whole context.

    The context is gathered from the cache by whole blocks: run i owns kv_blocks[cu_k[i] // block_size :
    cu_k[i + 1] // block_size], so its keys are padded to a whole number of blocks and flash reads only the first
    seqused_k[i] of them. Why: the slot-by-slot gather this replaced moved 384-byte rows (SmolLM2-135M) at about
    1.2 TB/s of the H200's 4.8 and was the costliest kernel of a decode step of 256 sequences (36% of the GPU time
    for the 135M model, 21% for Llama-3.1-8B); a block is one row of block_size x kv_heads x head_dim x 2 bytes
    (6 KB for the 135M model), and see _gather_blocks for how it is gathered near memory bandwidth."""

    kv_blocks: torch.Tensor  # [total blocks] int64: the cache blocks of every run's context, run after run
    cu_q: torch.Tensor  # [runs + 1] int32 cumulative query lengths
    cu_k: torch.Tensor  # [runs + 1] int32 cumulative padded context lengths (blocks x block_size per run)
    seqused_k: torch.Tensor  # [runs] int32 the real context lengths (at least 1)
    max_q: int
    max_k: int  # the longest padded context


@dataclass
class StepAttention:
    """Everything attention needs about the packed batch of one step; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    num_decodes: int  # the first num_decodes rows are single-token sequences
    decode_blocks: torch.Tensor | None = None  # [num_decodes * blocks per sequence] block tables padded with 0
    decode_lengths: torch.Tensor | None = None  # [num_decodes] int64 each decode's context length
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, blocks * block_size] bool: True = attend
    prefills: list[PrefillRun] = field(default_factory=list)
    varlen: VarlenAttention | None = None  # set instead of the rest where flash varlen attention runs


# (q [tokens, heads, d], one layer's cache [2, blocks, block_size, kv_heads, d], the step, scaling) -> [tokens, heads, d]
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, VarlenAttention, float], torch.Tensor]


def gathered_flash(q: torch.Tensor, layer_kv: torch.Tensor, step: VarlenAttention, scaling: float) -> torch.Tensor:
    """Every run's context gathered by whole blocks, then one flash varlen call."""
    k, v = _gather_blocks(layer_kv, step.kv_blocks)
    return flash_varlen(q.contiguous(), k, v, step.cu_q, step.cu_k, step.seqused_k, step.max_q, step.max_k, scaling)


@dataclass(frozen=True)
class VarlenKernels:
    """The kernel of each kind of varlen step: decode-only (max_q 1) and with prompt tokens."""

    decodes: VarlenKernel = gathered_flash
    mixed: VarlenKernel = gathered_flash


class _Current:
    """The step being computed, the cache it uses and the kernels of varlen steps (one forward pass at a time per
    process; the model runner sets them)."""

    step: StepAttention | None = None
    kv_cache: Any = None  # enginecore.kv_cache.KVCache
    kernels = VarlenKernels()


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
    q = query[0].transpose(0, 1)  # [T, heads, d]
    if step.varlen is not None:
        return attend_stored(layer, q, scaling).unsqueeze(0), None
    return attend_written(layer, q, scaling, k_new, v_new).unsqueeze(0), None


def attend_written(layer: int, q: torch.Tensor, scaling, k_new: torch.Tensor | None = None,
                   v_new: torch.Tensor | None = None) -> torch.Tensor:
    """A step's attention by batched decodes and one call per prompt run, the step's K/V already in the cache:
    q [T, heads, d] -> [T, heads, d]. A run that starts its sequence attends to its own new K/V: k_new and v_new
    [T, kv_heads, d] where the caller has them, else read back from their slots. The lean forward calls it
    directly on the CPU where it wrote K/V itself (enginecore.cpu_layer_ops)."""
    step = current.step
    assert step is not None and step.varlen is None
    num_tokens, heads, head_dim = q.shape
    k_slots, v_slots = current.kv_cache.slots[layer]
    kv_heads = k_slots.shape[1]
    group = heads // kv_heads
    if not step.prefills:  # all decodes: one batched op, no copy into a separate output
        return _decode(layer, q, step, kv_heads, group, scaling)

    out = q.new_empty(num_tokens, heads, head_dim)
    b = step.num_decodes
    if b:
        out[:b] = _decode(layer, q[:b], step, kv_heads, group, scaling)
    for run in step.prefills:
        qr = q[run.start:run.end].transpose(0, 1)[None]  # [1, heads, n, d]
        if run.context_blocks is None:
            if k_new is None or v_new is None:
                slots = step.slot_mapping[run.start:run.end]
                k_run, v_run = k_slots.index_select(0, slots), v_slots.index_select(0, slots)
            else:
                k_run, v_run = k_new[run.start:run.end], v_new[run.start:run.end]
            o = sdpa(qr, k_run.transpose(0, 1)[None], v_run.transpose(0, 1)[None], is_causal=True, scale=scaling,
                     enable_gqa=group > 1)
        else:
            k, v = _gather(current.kv_cache.layers[layer], run.context_blocks, run.context_len)
            o = sdpa(qr, k, v, attn_mask=run.mask, scale=scaling, enable_gqa=group > 1)
        out[run.start:run.end] = o[0].transpose(0, 1)
    return out


def attend_stored(layer: int, q: torch.Tensor, scaling) -> torch.Tensor:
    """A varlen step's attention, the step's K/V already in the cache: q [tokens, heads, d] -> [tokens, heads, d].
    Causal, aligned to the end of each sequence's context (bottom right): right for a decode, a fresh prompt and a
    chunk after cached tokens alike. The lean forward calls it directly where it wrote K/V itself
    (enginecore.rope_triton)."""
    assert current.step is not None and current.step.varlen is not None and current.kv_cache is not None
    step = current.step.varlen
    kernel = current.kernels.decodes if step.max_q == 1 else current.kernels.mixed
    return kernel(q, current.kv_cache.layers[layer], step, scaling)


def _gather_blocks(layer_kv: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks, each [len(block_ids) * block_size, kv_heads, d], contiguous.

    One index_select over the leading dimension each. Measured on the H200 (bfloat16, 256 sequences x 16 blocks of
    16 tokens, random block ids), K plus V: 28 us (3.5 TB/s read + written; a plain copy of as many bytes: 26 us)
    for the 135M shape, 122 us (4.4 TB/s) for Llama-3.1-8B's. A single index_select over dimension 1 of the
    [2, blocks, ...] layer, K and V in one call, takes torch's slower strided path: 82 us and 414 us, no better
    than the slot gather (85 us, 141 us) for the 135M shape and three times worse for the 8B's. On the CPU
    (bench/kv_gather.py, 2-core Intel Xeon, float32): 36 against 97 us for 8 decodes of 128 tokens, 500 against
    900 us for 32 of 256; a single decode of 128 tokens pays for the second call, 12 against 5 us."""
    return (layer_kv[0].index_select(0, block_ids).flatten(0, 1),
            layer_kv[1].index_select(0, block_ids).flatten(0, 1))


def flash_varlen(q, k, v, cu_q, cu_k, seqused_k, max_q: int, max_k: int, scaling) -> torch.Tensor:
    """[total_q, heads, d] -> [total_q, heads, d]; k/v [total_k, kv_heads, d] (flash attention handles GQA).
    Run i: queries cu_q[i]..cu_q[i+1] against the seqused_k[i] keys from cu_k[i] on, causal aligned bottom right
    (the last query sees every one of them); what follows them up to cu_k[i+1] is padding, never read."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scaling, seqused_k=seqused_k)[0]


def varlen_reference(q, k, v, cu_q, cu_k, seqused_k, max_q: int, max_k: int, scaling) -> torch.Tensor:
    """What flash_varlen computes, in plain torch (SDPA run by run): the start-up probe's and the tests' yardstick."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(seqused_k)):
        q0, q1, k0 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
        used = int(seqused_k[i])
        # Query j of n sits at position used - n + j of the context: it sees keys 0 .. used - n + j.
        mask = torch.ones(q1 - q0, used, dtype=torch.bool, device=q.device).tril(used - (q1 - q0))
        o = sdpa(q[None, q0:q1].transpose(1, 2), k[None, k0:k0 + used].transpose(1, 2),
                 v[None, k0:k0 + used].transpose(1, 2), attn_mask=mask, scale=scaling, enable_gqa=group > 1)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _gather(layer_kv: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context K and V, each [1, kv_heads, length, d]."""
    k, v = _gather_blocks(layer_kv, block_ids)
    return k[None, :length].transpose(1, 2), v[None, :length].transpose(1, 2)


def _decode(layer: int, q: torch.Tensor, step: StepAttention, kv_heads: int, group: int, scaling) -> torch.Tensor:
    """q [B, heads, d] -> [B, heads, d]. On the CPU in float32, by our kernel, which reads each row's blocks where
    they lie (enginecore.cpu_attention). Else each query head attends with the other heads of its KV group, packed
    as the 'query length' dimension of SDPA, so no K/V is repeated per head."""
    b, heads, d = q.shape
    assert step.decode_blocks is not None  # set wherever a step has decodes and no varlen attention
    cache = current.kv_cache
    if cache.tensor.device.type == "cpu" and cache.tensor.dtype == torch.float32 and step.decode_lengths is not None:
        kernel = cpu_attention.kernel()
        if kernel is not None:
            return cpu_attention.decode(q, cache.layer_addresses[layer], step.decode_blocks, step.decode_lengths,
                                        scaling, kernel)
    k, v = _gather_blocks(cache.layers[layer], step.decode_blocks)  # each [B * L, kv_heads, d]
    k, v = (t.view(b, -1, kv_heads, d).transpose(1, 2) for t in (k, v))  # [B, kv_heads, L, d]
    o = sdpa(q.reshape(b, kv_heads, group, d), k, v, attn_mask=step.decode_mask, scale=scaling)  # [B, kv_heads, group, d]
    return o.reshape(b, heads, d)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
