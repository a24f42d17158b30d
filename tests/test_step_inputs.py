"""enginecore.step_inputs against a plain, token-by-token description of the same step: every tensor exactly equal,
for mixed batches (decodes, one-token prompt chunks, prompt chunks, prompt logprobs, pending placeholder tokens,
block tables longer than the context), for both attention layouts, and padded for CUDA graphs: a decode batch, and a
varlen step of any kind."""
from __future__ import annotations

import random

import torch

from enginecore.sequence import Sequence
import pytest
from enginecore.step_inputs import DecodePadding, MixedPadding, build_step_inputs
from ipc.sampling import SamplingParams

BLOCK = 4
CPU = torch.device("cpu")


def _seq(rng: random.Random, computed: int, total: int, prompt: int, logprobs: int | None, extra_blocks: int = 0):
    tokens = [rng.randrange(1000) for _ in range(total)]
    if total > prompt and rng.random() < 0.5:
        tokens[-1] = -1 - rng.randrange(8)  # a token still pending on the device
    blocks = rng.sample(range(500), -(-total // BLOCK) + extra_blocks)
    return Sequence(seq_id=rng.randrange(10**6), request_id="x", client=None, index=0, token_ids=tokens,
                    num_prompt_tokens=prompt, sampling=SamplingParams(prompt_logprobs=logprobs), priority=0,
                    arrival=0, num_computed_tokens=computed, block_table=blocks,
                    num_prompt_logprobs=rng.randrange(prompt) if logprobs is not None else 0)


def _entries(rng: random.Random, decodes_only: bool = False):
    entries = []
    for _ in range(rng.randrange(1, 12)):
        total = rng.randrange(2, 40)
        kind = rng.random()
        if kind < 0.6:  # a decode
            entries.append((_seq(rng, total - 1, total, rng.randrange(1, total), 2 if rng.random() < 0.2 else None,
                                 extra_blocks=int(rng.random() < 0.2)), 1))
        elif not decodes_only and kind < 0.75:  # a one-token chunk of a prompt, maybe not its last
            prompt = total
            computed = rng.randrange(prompt)
            entries.append((_seq(rng, computed, total, prompt, 1 if rng.random() < 0.5 else None), 1))
        elif not decodes_only:  # a chunk of a prompt
            computed = rng.randrange(total - 1)
            n = rng.randrange(2, total - computed + 1)
            entries.append((_seq(rng, computed, total, total, 1 if rng.random() < 0.5 else None), n))
    if decodes_only and not entries:
        entries.append((_seq(rng, 3, 4, 2, None), 1))
    entries.sort(key=lambda e: e[1] != 1)  # single-token entries first, as the scheduler orders them
    return entries


def _expected(entries):
    """The step, token by token."""
    ids, positions, slots, sample_rows, sample_seqs, prompt_runs, prompt_rows = [], [], [], [], [], [], []
    row = 0
    for seq, n in entries:
        c = seq.num_computed_tokens
        for p in range(c, c + n):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        if seq.sampling.prompt_logprobs is not None:
            first, end = max(c, seq.num_prompt_logprobs), min(c + n, seq.num_prompt_tokens - 1)
            if first < end:
                prompt_runs.append((seq, first, end - first))
                prompt_rows += [row + p - c for p in range(first, end)]
        row += n
        if c + n == seq.num_tokens:
            sample_rows.append(row - 1)
            sample_seqs.append(seq)
    return ids, positions, slots, sample_rows + prompt_rows, sample_seqs, prompt_runs


def _check_common(inputs, entries, want_rows=None):
    ids, positions, slots, rows, seqs, runs = _expected(entries)
    n = len(ids)
    assert inputs.input_ids.dtype == torch.int64 and inputs.input_ids.shape[0] == 1
    assert inputs.input_ids[0, :n].tolist() == ids
    assert inputs.positions[0, :n].tolist() == positions
    assert inputs.attention.slot_mapping[:n].tolist() == slots
    if want_rows is None:
        assert inputs.sample_rows.tolist() == rows
        assert [id(s) for s in inputs.sample_seqs] == [id(s) for s in seqs]
        assert [(id(s), f, c) for s, f, c in inputs.prompt_runs] == [(id(s), f, c) for s, f, c in runs]
        assert inputs.num_tokens == n


def test_mixed_steps_match_the_token_by_token_description():
    rng = random.Random(0)
    for _ in range(300):
        entries = _entries(rng)
        for varlen in (False, True):
            inputs = build_step_inputs(entries, BLOCK, CPU, varlen=varlen)
            _check_common(inputs, entries)
            att = inputs.attention
            ones = [seq for seq, n in entries if n == 1]
            ctx = [seq.num_computed_tokens + n for seq, n in entries]
            assert att.num_decodes == len(ones)
            if varlen:
                v = att.varlen
                counts = [-(-k // BLOCK) for k in ctx]
                assert v.kv_blocks.tolist() == [b for (seq, _), c in zip(entries, counts) for b in seq.block_table[:c]]
                assert v.seqused_k.tolist() == ctx
                assert v.cu_k.tolist() == [sum(counts[:i]) * BLOCK for i in range(len(entries) + 1)]
                assert v.cu_q.tolist() == [sum(n for _, n in entries[:i]) for i in range(len(entries) + 1)]
            else:
                if ones:
                    blocks = -(-max(ctx[:len(ones)]) // BLOCK)
                    table = att.decode_blocks.view(len(ones), blocks).tolist()
                    for row, seq in enumerate(ones):
                        own = seq.block_table[:blocks]
                        assert table[row] == own + [0] * (blocks - len(own))
                    mask = att.decode_mask[:, 0, 0, :].tolist()
                    assert mask == [[j < k for j in range(blocks * BLOCK)] for k in ctx[:len(ones)]]
                assert len(att.prefills) == len(entries) - len(ones)


def test_padded_decode_batches_match_the_token_by_token_description():
    rng = random.Random(1)
    for _ in range(200):
        entries = [(seq, 1) for seq, _ in _entries(rng, decodes_only=True)]
        ctx = [seq.num_computed_tokens + 1 for seq, _ in entries]
        padding = DecodePadding(batch=len(entries) + rng.randrange(4),
                                blocks=-(-max(ctx) // BLOCK) + rng.randrange(2), scratch_block=999)
        rows, blocks = padding.batch, padding.blocks
        for varlen in (False, True):
            inputs = build_step_inputs(entries, BLOCK, CPU, padding, varlen=varlen)
            _check_common(inputs, entries, want_rows=True)
            b = len(entries)
            assert inputs.input_ids[0, b:].tolist() == [0] * (rows - b)
            assert inputs.positions[0, b:].tolist() == [0] * (rows - b)
            assert inputs.attention.slot_mapping[b:].tolist() == [999 * BLOCK] * (rows - b)
            assert inputs.sample_rows.tolist() == list(range(rows))
            assert inputs.sample_seqs == [seq for seq, _ in entries] and inputs.num_tokens == rows
            assert inputs.graph_shape == (rows, blocks)
            want_table = [seq.block_table[:blocks] + [999] * (blocks - len(seq.block_table[:blocks]))
                          for seq, _ in entries] + [[999] * blocks] * (rows - b)
            lengths = ctx + [1] * (rows - b)
            att = inputs.attention
            if varlen:
                assert att.varlen.kv_blocks.view(rows, blocks).tolist() == want_table
                assert att.varlen.seqused_k.tolist() == lengths
            else:
                assert att.decode_blocks.view(rows, blocks).tolist() == want_table
                assert att.decode_mask[:, 0, 0, :].tolist() == [[j < k for j in range(blocks * BLOCK)]
                                                                 for k in lengths]


def test_mixed_padding_keeps_the_step_and_adds_padding_runs():
    """A varlen step padded to a CUDA graph's (tokens, runs, blocks): the real rows and runs as unpadded; the first
    padding run takes the padding tokens, the last the padding blocks, each sees one scratch slot; max_q and max_k
    are the graph's bounds."""
    rng = random.Random(2)
    for _ in range(300):
        entries = _entries(rng)
        ctx = [seq.num_computed_tokens + n for seq, n in entries]
        counts = [-(-k // BLOCK) for k in ctx]
        tokens, runs, blocks = sum(n for _, n in entries), len(entries), sum(counts)
        extra_runs = 1 + rng.randrange(3)
        padding = MixedPadding(tokens=tokens + rng.randrange(6), runs=runs + extra_runs,
                               blocks=blocks + extra_runs + rng.randrange(5), scratch_block=999)
        inputs = build_step_inputs(entries, BLOCK, CPU, padding, varlen=True)
        _check_common(inputs, entries)
        pad = padding.tokens - tokens
        assert inputs.input_ids[0, tokens:].tolist() == [0] * pad
        assert inputs.positions[0, tokens:].tolist() == [0] * pad
        assert inputs.attention.slot_mapping[tokens:].tolist() == [999 * BLOCK] * pad
        assert inputs.graph_shape == (padding.tokens, padding.runs, padding.blocks)
        v = inputs.attention.varlen
        q_lens = [n for _, n in entries] + [pad] + [0] * (extra_runs - 1)
        block_counts = counts + [1] * (extra_runs - 1) + [padding.blocks - blocks - (extra_runs - 1)]
        assert v.cu_q.tolist() == [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
        assert v.cu_k.tolist() == [sum(block_counts[:i]) * BLOCK for i in range(len(block_counts) + 1)]
        assert v.seqused_k.tolist() == ctx + [1] * extra_runs
        assert v.kv_blocks.tolist() == ([b for (seq, _), c in zip(entries, counts) for b in seq.block_table[:c]]
                                        + [999] * (padding.blocks - blocks))
        assert (v.max_q, v.max_k) == (padding.tokens, padding.blocks * BLOCK)


def test_mixed_padding_that_does_not_fit_is_refused():
    entries = _entries(random.Random(3))
    tokens, runs = sum(n for _, n in entries), len(entries)
    blocks = sum(-(-(seq.num_computed_tokens + n) // BLOCK) for seq, n in entries)
    for bad in (MixedPadding(tokens - 1, runs + 1, blocks + 1, 999),  # too few tokens
                MixedPadding(tokens, runs, blocks + 1, 999),  # no padding run
                MixedPadding(tokens, runs + 2, blocks + 1, 999)):  # too few blocks for two padding runs
        with pytest.raises(ValueError):
            build_step_inputs(entries, BLOCK, CPU, bad, varlen=True)
    with pytest.raises(ValueError):
        build_step_inputs(entries, BLOCK, CPU, MixedPadding(tokens, runs + 1, blocks + 1, 999), varlen=False)
