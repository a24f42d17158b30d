"""From a scheduled batch to the tensors of one forward pass: the packed token ids and positions, where each
token's K/V goes, what each sequence attends to, and which rows' logits to sample from.

Built with numpy on the host in one pass per step, so the per-layer attention code does no Python bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from enginecore.attention import PrefillRun, StepAttention
from enginecore.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    attention: StepAttention
    sample_rows: torch.Tensor  # [k] rows of the packed batch whose logits are sampled
    sample_seqs: list[Sequence]  # the sequences those rows belong to, in the same order
    num_tokens: int


def build_step_inputs(entries: list[tuple[Sequence, int]], block_size: int, device: torch.device) -> StepInputs:
    """entries: (sequence, number of new tokens), single-token entries first (the scheduler orders them so)."""
    ids: list[int] = []
    starts: list[int] = []  # first new position of each entry
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
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
        row += n
        if start + n == seq.num_tokens:  # its last known token is in: the logits give its next token
            sample_rows.append(row - 1)
            sample_seqs.append(seq)

    positions = np.empty(row, dtype=np.int64)
    slots = np.empty(row, dtype=np.int64)
    prefills: list[PrefillRun] = []
    decode_ctx = np.empty(num_decodes, dtype=np.int64)
    r = 0
    for i, (seq, n) in enumerate(entries):
        start = starts[i]
        if n == 1:
            block = seq.block_table[start // block_size]
            positions[r] = start
            slots[r] = block * block_size + start % block_size
            decode_ctx[i] = start + 1
        else:
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions[r:r + n] = pos
            slots[r:r + n] = table[pos // block_size] * block_size + pos % block_size
            prefills.append(_prefill_run(r, start, n, table, block_size))
        r += n

    attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=num_decodes, prefills=prefills)
    if num_decodes:
        max_blocks = -(-int(decode_ctx.max()) // block_size)
        tables = np.zeros((num_decodes, max_blocks), dtype=np.int64)
        for i in range(num_decodes):
            table = entries[i][0].block_table[:max_blocks]
            tables[i, :len(table)] = table
        mask = np.arange(max_blocks * block_size)[None, :] < decode_ctx[:, None]
        attention.decode_blocks = _to(tables.reshape(-1), device)
        attention.decode_mask = _to(mask[:, None, None, :], device)
    for run in prefills:
        if run.context_blocks is not None:
            run.context_blocks = run.context_blocks.to(device, non_blocking=True)
            run.mask = run.mask.to(device, non_blocking=True)
    return StepInputs(
        input_ids=_to(np.asarray(ids, dtype=np.int64), device)[None],
        positions=_to(positions, device)[None],
        attention=attention,
        sample_rows=_to(np.asarray(sample_rows, dtype=np.int64), device),
        sample_seqs=sample_seqs,
        num_tokens=row,
    )


def _prefill_run(row: int, start: int, n: int, table: np.ndarray, block_size: int) -> PrefillRun:
    run = PrefillRun(start=row, end=row + n)
    if start > 0:  # part of its context is in the cache already (an earlier chunk, or a prefix hit)
        context = start + n
        run.context_len = context
        run.context_blocks = torch.from_numpy(table[:-(-context // block_size)])
        allowed = np.arange(context)[None, :] <= np.arange(start, start + n)[:, None]
        run.mask = torch.from_numpy(allowed)
    return run


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
