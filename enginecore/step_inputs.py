"""From a scheduled batch to the tensors of one forward pass: the packed token ids and positions, where each
token's K/V goes, what each sequence attends to, and which rows' logits to sample from (plus, for a sequence
that asks for prompt logprobs, the rows of its prompt positions).

Built with numpy on the host in one pass per step, so the per-layer attention code does no Python bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

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
    # The shape of the CUDA graph the step is padded for, None when it runs eagerly: a decode-only batch's
    # (batch size, blocks per sequence) (DecodePadding), or a flash varlen step's (tokens, runs, blocks in all)
    # (MixedPadding).
    graph_shape: tuple[int, ...] | None = None


@dataclass
class DecodePadding:
    """Pad a decode-only batch to `batch` rows and `blocks` blocks per row; padding rows write to `scratch_block`."""

    batch: int
    blocks: int
    scratch_block: int


@dataclass
class MixedPadding:
    """Pad a flash varlen step of any kind (decodes and prompt chunks) to `tokens` rows, `runs` runs and `blocks`
    context blocks in all, the shape of a CUDA graph of its layers. There is at least one padding run: the first
    takes the padding tokens, the last the padding blocks; each sees one slot of `scratch_block`, where the padding
    tokens' K/V goes. So `runs` > the step's runs and `blocks` >= its blocks + its padding runs."""

    tokens: int
    runs: int
    blocks: int
    scratch_block: int


def build_step_inputs(entries: list[tuple[Sequence, int]], block_size: int, device: torch.device,
                      padding: DecodePadding | MixedPadding | None = None, varlen: bool = False) -> StepInputs:
    """entries: (sequence, number of new tokens), single-token entries first (the scheduler orders them so).
    varlen: describe the step for one flash varlen attention call (CUDA) instead of batched decodes plus one
    attention call per prefill run (a MixedPadding needs varlen)."""
    if isinstance(padding, DecodePadding):
        return _padded_decode_inputs(entries, block_size, device, padding, varlen)
    if padding is not None and not varlen:
        raise ValueError("a mixed step is padded for flash varlen attention only")
    # The leading single-token entries (decodes, or one-token prompt chunks) as arrays, the rest one by one.
    d = 0
    while d < len(entries) and entries[d][1] == 1:
        d += 1
    dec_ids, dec_pos, dec_slots, dec_tokens, dec_logprobs = _single_token_rows(entries[:d], block_size)
    sampled = dec_pos + 1 == dec_tokens  # its last known token is in: the logits give its next token
    sample_rows = np.flatnonzero(sampled)
    sample_seqs = [seq for seq, _ in entries[:d]] if len(sample_rows) == d else \
        [entries[i][0] for i in sample_rows.tolist()]
    ids: list[int] = []  # of the entries after the leading single-token ones
    starts: list[int] = []  # first new position of each of those entries
    rest_sample_rows: list[int] = []
    prompt_runs: list[tuple[Sequence, int, int]] = []
    prompt_rows: list[int] = []
    num_decodes = d
    for i in np.flatnonzero(dec_logprobs).tolist():
        seq, start = entries[i][0], int(dec_pos[i])
        if max(start, seq.num_prompt_logprobs) < min(start + 1, seq.num_prompt_tokens - 1):
            prompt_runs.append((seq, start, 1))
            prompt_rows.append(i)
    row = d
    for seq, n in entries[d:]:
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
            rest_sample_rows.append(row - 1)
            sample_seqs.append(seq)

    positions = np.empty(row, dtype=np.int64)
    slots = np.empty(row, dtype=np.int64)
    positions[:d] = dec_pos
    slots[:d] = dec_slots
    prefills: list[PrefillRun] = []
    # varlen: every run's context blocks and real context length, decodes first.
    run_blocks: list[list[int] | np.ndarray] = []
    k_lens = np.empty(len(entries), dtype=np.int64)
    k_lens[:d] = dec_pos + 1
    decode_ctx = k_lens[:num_decodes]
    if varlen and d:
        run_blocks.append(_flat_tables([seq.block_table[:start // block_size + 1]
                                        for (seq, _), start in zip(entries[:d], dec_pos.tolist())]))
    r = d
    for i in range(d, len(entries)):
        seq, n = entries[i]
        start = starts[i - d]
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

    all_ids = dec_ids if not ids else np.concatenate([dec_ids, np.asarray(ids, dtype=np.int64)])
    rows = np.concatenate([sample_rows, np.asarray(rest_sample_rows + prompt_rows, dtype=np.int64)])
    graph_shape = None
    if varlen:
        runs = _Runs(np.concatenate(run_blocks).astype(np.int64, copy=False), -(-k_lens // block_size),
                     np.array([n for _, n in entries]), k_lens)
        if padding is not None:
            all_ids, positions, slots, runs = _pad_mixed(all_ids, positions, slots, runs, padding, block_size)
            graph_shape = (padding.tokens, padding.runs, padding.blocks)
    attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=num_decodes, prefills=prefills)
    if varlen:
        attention.varlen = _varlen(runs, block_size, device, padding)
    elif num_decodes:
        max_blocks = -(-int(decode_ctx.max()) // block_size)
        tables = _block_tables([seq.block_table for seq, _ in entries[:num_decodes]], max_blocks, num_decodes, 0)
        attention.decode_blocks = _to(tables.reshape(-1), device)
        lengths = _lengths(decode_ctx, num_decodes)
        attention.decode_lengths = _to(lengths, device)
        attention.decode_mask = _to(_length_mask(lengths, max_blocks, block_size), device)
    return StepInputs(
        input_ids=_to(all_ids, device)[None],
        positions=_to(positions, device)[None],
        attention=attention,
        sample_rows=_to(rows, device),
        sample_seqs=sample_seqs,
        num_tokens=row,
        prompt_runs=prompt_runs,
        graph_shape=graph_shape,
    )


def _single_token_rows(entries, block_size: int) -> tuple[np.ndarray, ...]:
    """The token ids, positions, KV slots and token counts of single-token entries, and whether each wants prompt
    logprobs: one Python pass."""
    rows = [(seq.token_ids[c], c, seq.block_table[c // block_size], len(seq.token_ids),
             seq.sampling.prompt_logprobs is not None)
            for seq, _ in entries for c in (seq.num_computed_tokens,)]
    columns = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=5 * len(rows)).reshape(-1, 5).T.copy()
    ids, positions, last_blocks, num_tokens, wants_logprobs = columns
    return ids, positions, last_blocks * block_size + positions % block_size, num_tokens, wants_logprobs


def _flat_tables(tables: list[list[int]]) -> np.ndarray:
    return np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=sum(map(len, tables)))


class _Runs(NamedTuple):
    """A varlen step's runs on the host: every run's context blocks, run after run (block_counts[i] of them for run
    i), its new tokens (q_lens) and its real context length (k_lens)."""

    blocks: np.ndarray
    block_counts: np.ndarray
    q_lens: np.ndarray
    k_lens: np.ndarray


def _varlen(runs: _Runs, block_size: int, device: torch.device, padding: MixedPadding | None = None
            ) -> VarlenAttention:
    """Each run's keys are its blocks whole (cu_k), of which flash reads k_lens[i] (seqused_k). For a CUDA graph
    (`padding`), max_q and max_k are the graph's bounds, not this step's: the graph keeps the values it was
    captured with (flash sizes its grid by max_q and reads only each run's real lengths)."""
    padded = runs.block_counts * block_size
    return VarlenAttention(
        kv_blocks=_to(runs.blocks, device),
        cu_q=_to(np.concatenate([[0], np.cumsum(runs.q_lens)]).astype(np.int32), device),
        cu_k=_to(np.concatenate([[0], np.cumsum(padded)]).astype(np.int32), device),
        seqused_k=_to(runs.k_lens.astype(np.int32), device),
        max_q=int(runs.q_lens.max()) if padding is None else padding.tokens,
        max_k=int(padded.max()) if padding is None else padding.blocks * block_size,
    )


def _pad_mixed(ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, runs: _Runs, padding: MixedPadding,
               block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Runs]:
    """The step's tokens and runs padded to `padding` (see MixedPadding)."""
    tokens, extra_runs = len(ids), padding.runs - len(runs.q_lens)
    extra_blocks = padding.blocks - len(runs.blocks)
    if tokens > padding.tokens or extra_runs < 1 or extra_blocks < extra_runs:
        raise ValueError(f"a step of {tokens} tokens, {len(runs.q_lens)} runs and {len(runs.blocks)} blocks does "
                         f"not fit {padding}")
    extra_tokens = padding.tokens - tokens
    q_lens = np.zeros(extra_runs, dtype=np.int64)
    q_lens[0] = extra_tokens
    block_counts = np.ones(extra_runs, dtype=np.int64)
    block_counts[-1] += extra_blocks - extra_runs
    return (
        np.concatenate([ids, np.zeros(extra_tokens, dtype=np.int64)]),
        np.concatenate([positions, np.zeros(extra_tokens, dtype=np.int64)]),
        np.concatenate([slots, np.full(extra_tokens, padding.scratch_block * block_size, dtype=np.int64)]),
        _Runs(np.concatenate([runs.blocks, np.full(extra_blocks, padding.scratch_block, dtype=np.int64)]),
              np.concatenate([runs.block_counts, block_counts]),
              np.concatenate([runs.q_lens, q_lens]),
              np.concatenate([runs.k_lens, np.ones(extra_runs, dtype=np.int64)])),
    )


def _block_tables(tables: list[list[int]], blocks: int, rows: int, pad_block: int) -> np.ndarray:
    """Block tables [rows, blocks] of the single-token sequences (their tables given), padded with pad_block
    (padding rows: all of it)."""
    out = np.full((rows, blocks), pad_block, dtype=np.int64)
    if not tables:
        return out
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    if lengths.max() > blocks:
        tables = [table[:blocks] for table in tables]
        lengths = np.minimum(lengths, blocks)
    # Each row's blocks fill a prefix of it: a row-major mask takes the concatenated tables in order.
    out[:len(tables)][np.arange(blocks) < lengths[:, None]] = _flat_tables(tables)
    return out


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
    dec_ids, dec_pos, dec_slots, _, _ = _single_token_rows(entries, block_size)
    ids = np.zeros(rows, dtype=np.int64)
    positions = np.zeros(rows, dtype=np.int64)
    slots = np.full(rows, padding.scratch_block * block_size, dtype=np.int64)
    ids[:b] = dec_ids
    positions[:b] = dec_pos
    slots[:b] = dec_slots
    ctx = dec_pos + 1
    # Static shapes for the graph: every row has padding.blocks blocks, the scratch block where it has fewer.
    tables = _block_tables([seq.block_table for seq, _ in entries], padding.blocks, rows, padding.scratch_block)
    lengths = _lengths(ctx, rows)
    if varlen:
        runs = _Runs(tables.reshape(-1), np.full(rows, padding.blocks), np.ones(rows, dtype=np.int64), lengths)
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=0,
                                  varlen=_varlen(runs, block_size, device))
    else:
        attention = StepAttention(slot_mapping=_to(slots, device), num_decodes=rows,
                                  decode_blocks=_to(tables.reshape(-1), device), decode_lengths=_to(lengths, device),
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
