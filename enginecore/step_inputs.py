"""From a scheduled batch to the tensors of one forward pass: the packed token ids and positions, where each
token's K/V goes, what each sequence attends to, and which rows' logits to sample from (plus, for a sequence
that asks for prompt logprobs, the rows of its prompt positions).

Built with numpy on the host in one pass per step, so the per-layer attention code does no Python bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from enginecore.attention import PrefillRun, StepAttention, VarlenAttention
from enginecore.host_to_device import to_device
from enginecore.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    attention: StepAttention
    # Rows of the packed batch whose logits are computed: the k sampled rows (one per sample_seqs entry), then the
    # rows of prompt_runs in order.
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]  # the sequences the sampled rows belong to, in the same order
    num_tokens: int
    # Prompt logprobs: (sequence, first position, count): the logits of positions first .. first+count-1 give the
    # logprobs of its prompt tokens at first+1 .. first+count. Empty unless a sequence asks for them.
    prompt_runs: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # A decode-only batch padded to a CUDA graph's shape: (batch size, blocks per sequence); None otherwise.
    graph_shape: tuple[int, int] | None = None


@dataclass
class DecodePadding:
    """Pad a decode-only batch to `batch` rows and `blocks` blocks per row; padding rows write to `scratch_block`."""

    batch: int
    blocks: int
    scratch_block: int


def build_step_inputs(entries: list[tuple[Sequence, int]], block_size: int, device: torch.device,
                      padding: DecodePadding | None = None, varlen: bool = False) -> StepInputs:
    """entries: (sequence, number of new tokens), single-token entries first (the scheduler orders them so).
    varlen: describe the step for one flash varlen attention call (CUDA) instead of batched decodes plus one
    attention call per prefill run."""
    if padding is not None:
        return _padded_decode_inputs(entries, block_size, device, padding, varlen)
    ids: list[int] = []
    starts: list[int] = []  # first new position of each entry
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    prompt_runs: list[tuple[Sequence, int, int]] = []
    prompt_rows: list[int] = []
    num_decodes = 0
    row = 0
    for seq, n in entries:
        start = seq.num_computed_tokens
        if n == 1:
            ids.append(seq.token_ids[start])
            num_decodes += 1
        else:
            ids.extend(seq.token_ids[start:start + n])
        starts.append(start)
        if seq.sampling.prompt_logprobs is not None:
            first, end = max(start, seq.num_prompt_logprobs), min(start + n, seq.num_prompt_tokens - 1)
            if first < end:
                prompt_runs.append((seq, first, end - first))
                prompt_rows.extend(range(row + first - start, row + end - start))
        row += n
        if start + n == seq.num_tokens:  # its last known token is in: the logits give its next token
            sample_rows.append(row - 1)
            sample_seqs.append(seq)

    positions = np.empty(row, dtype=np.int64)
    slots = np.empty(row, dtype=np.int64)
    prefills: list[PrefillRun] = []
    context_slots: list[np.ndarray] = []  # varlen: each prefill run's whole context, in cache slots
    decode_ctx = np.empty(num_decodes, dtype=np.int64)
    r = 0
    for i, (seq, n) in enumerate(entries):
        start = starts[i]
        if n == 1:
            positions[r] = start
            slots[r] = seq.block_table[start // block_size] * block_size + start % block_size
            decode_ctx[i] = start + 1
        else:
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions[r:r + n] = pos
            slots[r:r + n] = table[pos // block_size] * block_size + pos % block_size
            if varlen:
                ctx = np.arange(start + n)
                context_slots.append(table[ctx // block_size] * block_size + ctx % block_size)
            else:
                prefills.append(_prefill_run(r, start, n, table, block_size, device))
        r += n

    attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=num_decodes, prefills=prefills)
    if varlen:
        q_lens = [1] * num_decodes + [n for _, n in entries[num_decodes:]]
        decode_slots, decode_lens = _context_slots(entries[:num_decodes], decode_ctx, block_size, num_decodes, 0)
        k_lens = list(decode_lens) + [len(c) for c in context_slots]
        attention.varlen = _varlen(np.concatenate([decode_slots] + context_slots), q_lens, k_lens, device)
        num_decodes = 0  # nothing left for the batched decode path
    if num_decodes:
        max_blocks = -(-int(decode_ctx.max()) // block_size)
        tables, mask = _decode_tables(entries[:num_decodes], decode_ctx, max_blocks, num_decodes, block_size, 0)
        attention.decode_blocks = _to(tables.reshape(-1), device)
        attention.decode_mask = _to(mask, device)
    return StepInputs(
        input_ids=_to(np.asarray(ids, dtype=np.int64), device)[None],
        positions=_to(positions, device)[None],
        attention=attention,
        sample_rows=_to(np.asarray(sample_rows + prompt_rows, dtype=np.int64), device),
        sample_seqs=sample_seqs,
        num_tokens=row,
        prompt_runs=prompt_runs,
    )


def _varlen(kv_slots: np.ndarray, q_lens, k_lens, device: torch.device, max_k: int | None = None) -> VarlenAttention:
    return VarlenAttention(
        kv_slots=_to(kv_slots, device),
        cu_q=_to(np.cumsum([0, *q_lens]).astype(np.int32), device),
        cu_k=_to(np.cumsum([0, *k_lens]).astype(np.int32), device),
        max_q=int(max(q_lens)),
        max_k=max_k or int(max(k_lens)),
    )


def _context_slots(entries, ctx: np.ndarray, block_size: int, rows: int, pad_block: int):
    """Every single-token sequence's context in cache slots, packed one after the other, and the lengths
    (padding rows: one slot of pad_block)."""
    if rows == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    blocks = -(-int(ctx.max()) // block_size) if len(ctx) else 1
    tables, _ = _decode_tables(entries, ctx, blocks, rows, block_size, pad_block)
    grid = (tables[:, :, None] * block_size + np.arange(block_size)).reshape(rows, -1)
    lengths = np.ones(rows, dtype=np.int64)
    lengths[:len(ctx)] = ctx
    return grid[np.arange(grid.shape[1])[None, :] < lengths[:, None]], lengths


def _decode_tables(entries, ctx: np.ndarray, blocks: int, rows: int, block_size: int, pad_block: int):
    """Block tables [rows, blocks] (padded with pad_block) and the length mask [rows, 1, 1, blocks * block_size]."""
    tables = np.full((rows, blocks), pad_block, dtype=np.int64)
    for i, (seq, _) in enumerate(entries):
        table = seq.block_table[:blocks]
        tables[i, :len(table)] = table
    lengths = np.ones(rows, dtype=np.int64)  # padding rows look at one (scratch) slot: no empty softmax
    lengths[:len(ctx)] = ctx
    mask = np.arange(blocks * block_size)[None, :] < lengths[:, None]
    return tables, mask[:, None, None, :]


def _padded_decode_inputs(entries, block_size: int, device: torch.device, padding: DecodePadding,
                          varlen: bool) -> StepInputs:
    b, rows = len(entries), padding.batch
    ids = np.zeros(rows, dtype=np.int64)
    positions = np.zeros(rows, dtype=np.int64)
    slots = np.full(rows, padding.scratch_block * block_size, dtype=np.int64)
    ctx = np.empty(b, dtype=np.int64)
    for i, (seq, _) in enumerate(entries):
        start = seq.num_computed_tokens
        ids[i] = seq.token_ids[start]
        positions[i] = start
        slots[i] = seq.block_table[start // block_size] * block_size + start % block_size
        ctx[i] = start + 1
    if varlen:
        # Static shapes for the graph: the packed contexts padded to rows x blocks x block_size slots.
        kv_slots, lengths = _context_slots(entries, ctx, block_size, rows, padding.scratch_block)
        full = np.full(rows * padding.blocks * block_size, padding.scratch_block * block_size, dtype=np.int64)
        full[:len(kv_slots)] = kv_slots
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=0,
                                  varlen=_varlen(full, [1] * rows, lengths, device, padding.blocks * block_size))
    else:
        tables, mask = _decode_tables(entries, ctx, padding.blocks, rows, block_size, padding.scratch_block)
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=rows,
                                  decode_blocks=_to(tables.reshape(-1), device), decode_mask=_to(mask, device))
    return StepInputs(
        input_ids=_to(ids, device)[None],
        positions=_to(positions, device)[None],
        attention=attention,
        sample_rows=_to(np.arange(rows, dtype=np.int64), device),
        sample_seqs=[seq for seq, _ in entries],
        num_tokens=rows,
        graph_shape=(rows, padding.blocks),
    )


def _prefill_run(row: int, start: int, n: int, table: np.ndarray, block_size: int, device) -> PrefillRun:
    run = PrefillRun(start=row, end=row + n)
    if start > 0:  # part of its context is in the cache already (an earlier chunk, or a prefix hit)
        context = start + n
        run.context_len = context
        run.context_blocks = _to(table[:-(-context // block_size)], device)
        run.mask = _to(np.arange(context)[None, :] <= np.arange(start, start + n)[:, None], device)
    return run


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(array, device)
