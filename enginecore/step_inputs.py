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
    # varlen: every run's context blocks and real context length, decodes first.
    run_blocks: list[list[int] | np.ndarray] = []
    k_lens = np.empty(len(entries), dtype=np.int64)
    decode_ctx = k_lens[:num_decodes]
    r = 0
    for i, (seq, n) in enumerate(entries):
        start = starts[i]
        if n == 1:
            positions[r] = start
            slots[r] = seq.block_table[start // block_size] * block_size + start % block_size
            k_lens[i] = start + 1
            if varlen:
                run_blocks.append(seq.block_table[:start // block_size + 1])
        else:
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions[r:r + n] = pos
            slots[r:r + n] = table[pos // block_size] * block_size + pos % block_size
            k_lens[i] = start + n
            if varlen:
                run_blocks.append(table[:-(-(start + n) // block_size)])
            else:
                prefills.append(_prefill_run(r, start, n, table, block_size, device))
        r += n

    attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=num_decodes, prefills=prefills)
    if varlen:
        q_lens = np.array([n for _, n in entries])
        blocks = np.concatenate(run_blocks).astype(np.int64, copy=False)
        attention.varlen = _varlen(blocks, -(-k_lens // block_size), q_lens, k_lens, block_size, device)
        num_decodes = 0  # nothing left for the batched decode path
    if num_decodes:
        max_blocks = -(-int(decode_ctx.max()) // block_size)
        tables = _block_tables(entries[:num_decodes], max_blocks, num_decodes, 0)
        attention.decode_blocks = _to(tables.reshape(-1), device)
        attention.decode_mask = _to(_length_mask(_lengths(decode_ctx, num_decodes), max_blocks, block_size), device)
    return StepInputs(
        input_ids=_to(np.asarray(ids, dtype=np.int64), device)[None],
        positions=_to(positions, device)[None],
        attention=attention,
        sample_rows=_to(np.asarray(sample_rows + prompt_rows, dtype=np.int64), device),
        sample_seqs=sample_seqs,
        num_tokens=row,
        prompt_runs=prompt_runs,
    )


def _varlen(blocks: np.ndarray, block_counts: np.ndarray, q_lens: np.ndarray, k_lens: np.ndarray, block_size: int,
            device: torch.device) -> VarlenAttention:
    """blocks: every run's context blocks, run after run (block_counts[i] of them for run i); k_lens: the real
    context lengths. Each run's keys are its blocks whole (cu_k), of which flash reads k_lens[i] (seqused_k)."""
    padded = block_counts * block_size
    return VarlenAttention(
        kv_blocks=_to(blocks, device),
        cu_q=_to(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), device),
        cu_k=_to(np.concatenate([[0], np.cumsum(padded)]).astype(np.int32), device),
        seqused_k=_to(k_lens.astype(np.int32), device),
        max_q=int(q_lens.max()),
        max_k=int(padded.max()),
    )


def _block_tables(entries, blocks: int, rows: int, pad_block: int) -> np.ndarray:
    """Block tables [rows, blocks] of the single-token sequences, padded with pad_block (padding rows: all of it)."""
    tables = np.full((rows, blocks), pad_block, dtype=np.int64)
    for i, (seq, _) in enumerate(entries):
        table = seq.block_table[:blocks]
        tables[i, :len(table)] = table
    return tables


def _lengths(ctx: np.ndarray, rows: int) -> np.ndarray:
    """The context lengths of `rows` rows, the first len(ctx) of them given; padding rows look at one (scratch)
    slot: no empty softmax."""
    lengths = np.ones(rows, dtype=np.int64)
    lengths[:len(ctx)] = ctx
    return lengths


def _length_mask(lengths: np.ndarray, blocks: int, block_size: int) -> np.ndarray:
    """[rows, 1, 1, blocks * block_size] bool: True where a row attends."""
    mask = np.arange(blocks * block_size)[None, :] < lengths[:, None]
    return mask[:, None, None, :]


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
    # Static shapes for the graph: every row has padding.blocks blocks, the scratch block where it has fewer.
    tables = _block_tables(entries, padding.blocks, rows, padding.scratch_block)
    lengths = _lengths(ctx, rows)
    if varlen:
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=0,
                                  varlen=_varlen(tables.reshape(-1), np.full(rows, padding.blocks),
                                                 np.ones(rows, dtype=np.int64), lengths, block_size, device))
    else:
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=rows,
                                  decode_blocks=_to(tables.reshape(-1), device),
                                  decode_mask=_to(_length_mask(lengths, padding.blocks, block_size), device))
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
