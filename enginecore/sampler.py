"""Sampler: the next token of every sequence of a step from its logits row, all rows in batched tensor ops.

Order (as vLLM does): logit bias, penalties (repetition on prompt and output, presence and frequency on the
output), min_tokens (EOS and stop ids barred until then), then greedy rows take the argmax; the others are divided
by their temperature, cut by top_k, min_p and top_p, and drawn by inverting the cumulative distribution at one
uniform number per row (a multinomial draw that needs one random number, not one per vocabulary entry: filling a
[rows, vocab] tensor with random numbers costs more on the CPU than the rest of the step's sampling). A request
with a seed draws its number from its own generator, so its tokens do not depend on whatever else is in the batch.

Logprobs are those of the model's raw distribution (before logit bias, penalties and temperature), as vLLM reports
them. A step's structured-output mask (enginecore/structured_output.py) is applied first, to its constrained rows
only: their logprobs are those of the masked distribution.

sample() leaves its logits as they are (the mask too goes into its own copy): when a batch raises (a row whose
parameters the sampler cannot take), sample_each() samples the rows one by one from the same logits, each
constrained row under its own mask, so that only the culprits' requests fail.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from enginecore.engine_base import one_line
from enginecore.host_to_device import to_device
from enginecore.sequence import Sequence
from enginecore.structured_output import TokenMask

MAX_LOGPROBS = 20
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class SampleResult:
    token_ids: list[int | None]
    logprobs: list  # per row: None, or [sampled token's logprob, [[token_id, logprob], ...top k]]
    errors: list[str | None] | None = None  # sample_each only: per row, why it could not be sampled (None: it was)


class SampledTokens:
    """A step's sampled tokens (and logprobs) on their way to the host: the device work is queued and the copies
    to the host started; result() waits for those copies only, not for whatever the device runs after them (the
    next step's forward pass, under asynchronous scheduling). `token_ids` stays on the device: the next step's
    input rows read it there."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, want: list[int | None]):
        self.token_ids = tokens
        self.want = want
        self._host: list[torch.Tensor] = [tokens]
        if raw_logprobs is not None:
            k_max = min(MAX_LOGPROBS, max((k or 0) for k in want if k is not None))
            self._host.append(raw_logprobs.gather(1, tokens[:, None])[:, 0])
            if k_max > 0:
                top = torch.topk(raw_logprobs, k_max, dim=-1)
                self._host += [top.values, top.indices]
        self._ready = None
        if tokens.device.type == "cuda":
            self._host = [_to_host(t) for t in self._host]
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SampleResult:
        if self._ready is not None:
            self._ready.synchronize()
        lists = [t.tolist() for t in self._host]
        if len(lists) == 1:
            return SampleResult(lists[0], [None] * len(lists[0]))
        top_vals, top_ids = (lists[2], lists[3]) if len(lists) == 4 else (None, None)
        return SampleResult(lists[0], _logprob_entries(lists[1], top_vals, top_ids, self.want))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: tuple[int, ...], seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], allowed: TokenMask | None = None) -> SampleResult:
        """allowed: the step's TokenMask for its constrained rows, or None."""
        return self.launch(logits, seqs, allowed).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence], allowed: TokenMask | None = None) -> SampledTokens:
        """sample() without waiting: the tokens stay on the device, their copy to the host started."""
        params = [s.sampling for s in seqs]
        greedy = [p.greedy for p in params]
        penalized = [i for i, (s, p) in enumerate(zip(seqs, params)) if p.repetition_penalty != 1.0
                     or ((p.presence_penalty or p.frequency_penalty) and s.num_output_tokens)]
        barred = [i for i, (s, p) in enumerate(zip(seqs, params)) if s.num_output_tokens < p.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias_ids]
        work = logits.float()  # a copy in half precision, the same tensor in float32
        if work is logits and (allowed is not None or penalized or barred or biased or not all(greedy)):
            work = logits.clone()  # the steps below write into it
        logits = work
        if allowed is not None:
            allowed.apply(logits)
        want = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want) else None

        self._apply_logit_bias(logits, seqs, biased)
        self._apply_penalties(logits, seqs, penalized)
        self._apply_min_tokens(logits, seqs, barred, allowed.rows if allowed is not None else ())

        if all(greedy):
            tokens = _argmax(logits)
        else:
            tokens = self._draw(logits, seqs, greedy)
        return SampledTokens(tokens, raw_logprobs, want)

    def sample_each(self, logits: torch.Tensor, seqs: list[Sequence], allowed: TokenMask | None = None) -> SampleResult:
        """Each row alone (after sample() raised on the batch): a row that cannot be sampled gets its error and no
        token, the others their token (a seeded row draws from its own generator, a constrained one under its own
        row of `allowed`, as in a batch)."""
        tokens: list[int | None] = []
        logprobs: list = []
        errors: list[str | None] = []
        for i, seq in enumerate(seqs):
            try:
                one = self.sample(logits[i:i + 1], [seq], None if allowed is None else allowed.row(i))
            except Exception as exc:
                tokens.append(None)
                logprobs.append(None)
                errors.append(one_line(exc))
            else:
                tokens.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
                errors.append(None)
        return SampleResult(tokens, logprobs, errors)

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Every biased row's bias at once: one index_put_ over (row, token) pairs, whatever the number of rows."""
        if not rows:
            return
        ids, values = zip(*(self._logit_bias(seqs[i], logits) for i in rows))
        counts = [t.numel() for t in ids]
        # output_size: the pairs' count is known here; without it the device would have to tell the host (a sync).
        row_of = torch.repeat_interleave(to_device(rows, logits.device), to_device(counts, logits.device),
                                         output_size=sum(counts))
        logits.index_put_((row_of, torch.cat(ids)), torch.cat(values), accumulate=True)

    def _logit_bias(self, seq: Sequence, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """seq's bias as (ids, values) on the device, made once per request (its choices share it). Ids outside
        the vocabulary and values that are not finite are dropped: the API servers refuse them, and an index past
        the row would be a device-side assert on CUDA, fatal to the engine."""
        bias = seq.logit_bias
        if not isinstance(bias, tuple):
            p = seq.sampling
            kept = [(t, v) for t, v in zip(p.logit_bias_ids, p.logit_bias_values)
                    if 0 <= t < logits.shape[1] and math.isfinite(v)]
            bias = (to_device([t for t, _ in kept], logits.device, torch.int64),
                    to_device([v for _, v in kept], logits.device, torch.float32))
            seq.logit_bias = bias
        return bias

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        for i in rows:
            seq = seqs[i]
            p = seq.sampling
            if p.repetition_penalty != 1.0:
                seen = to_device(seq.token_ids, logits.device).unique()
                row = logits[i, seen]
                # A penalty near 0 (the API takes any above 0) overflowed a positive logit to inf, and the row's
                # infinities to NaN probabilities: a token of a page of garbage. At most float32's largest, such
                # tokens share the top.
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty,
                                              row * p.repetition_penalty).clamp_(max=FLOAT32_MAX)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                out = to_device(seq.output_token_ids, logits.device)
                counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                          constrained: Collection[int]) -> None:
        """min_tokens bars the end (EOS, stop ids) from `rows`. On a constrained row whose grammar allows nothing
        but the end here (a regex "" or a choice of "", at once), the grammar wins and the row may end: barred,
        every token would be -inf, and the token drawn (the vocabulary's last) one the grammar refuses, failing
        the request with a grammar error. A grammar that completes later ends its output the same way."""
        for i in rows:
            barred = self._min_tokens_barred(seqs[i], logits)
            if not barred.numel():
                continue
            row = logits[i]
            if i not in constrained:
                row.index_fill_(0, barred, float("-inf"))
                continue
            unbarred = row.clone()
            row.index_fill_(0, barred, float("-inf"))
            # Without reading the verdict back (a device sync): the row as it was where nothing else is left.
            row.copy_(torch.where(row.amax() == float("-inf"), unbarred, row))

    def _min_tokens_barred(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The ids `seq` may not end with yet, on the device, made once (a request may list the whole vocabulary
        as stop tokens). index_fill_ takes them there: indexing a CUDA tensor with a Python list copies the list
        over synchronously, and the host would wait for the GPU (asynchronous scheduling's overlap lost)."""
        barred = seq.min_tokens_barred
        if not isinstance(barred, torch.Tensor):
            ids = [*seq.stop_token_ids, *([] if seq.sampling.ignore_eos else self.eos_token_ids)]
            barred = to_device(sorted({t for t in ids if 0 <= t < logits.shape[1]}), logits.device)
            seq.min_tokens_barred = barred
        return barred

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        params = [s.sampling for s in seqs]
        dev = logits.device
        greedy_tokens = _argmax(logits) if any(greedy) else None
        temps = to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], dev)
        logits.div_(temps[:, None])

        top_ks = [p.top_k if 0 < p.top_k < logits.shape[1] and not g else 0 for p, g in zip(params, greedy)]
        if any(top_ks):
            k_max = max(top_ks)
            kth = torch.topk(logits, k_max, dim=-1).values  # [rows, k_max], descending
            ks = to_device([k if k else k_max for k in top_ks], dev)
            threshold = kth.gather(1, (ks - 1)[:, None])
            threshold[to_device([k == 0 for k in top_ks], dev)] = float("-inf")
            logits.masked_fill_(logits < threshold, float("-inf"))

        probs = torch.softmax(logits, dim=-1)
        min_ps = [p.min_p if not g else 0.0 for p, g in zip(params, greedy)]
        if any(min_ps):
            floor = to_device(min_ps, dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs.masked_fill_(probs < floor, 0.0)
        top_ps = [p.top_p if not g else 1.0 for p, g in zip(params, greedy)]
        rows = [i for i, tp in enumerate(top_ps) if tp < 1.0]
        if rows:
            idx = to_device(rows, dev)
            sub = probs[idx]
            sorted_p, order = sub.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            # Drop a token when the ones before it already reach top_p (the first token always stays).
            drop = (cum - sorted_p) > to_device([top_ps[i] for i in rows], dev)[:, None]
            sub.scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
            probs[idx] = sub

        uniform = torch.empty(len(seqs), 1, device=dev)
        seeded = [i for i, s in enumerate(seqs) if s.generator is not None and not greedy[i]]
        if len(seeded) < len(seqs):
            uniform.uniform_(generator=self.generator)
        for i in seeded:
            uniform[i] = torch.rand(1, device=dev, generator=seqs[i].generator)
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose cumulative probability exceeds u * total, never one of probability 0.
        tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
        if greedy_tokens is not None:
            tokens = torch.where(to_device(greedy, dev), greedy_tokens, tokens)
        return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max(dim).indices: the same first maximum as argmax, several times faster on the CPU.
    return logits.max(dim=-1).indices


# Prompt rows whose raw distribution is made at once. A step's prompt rows (up to --max-num-batched-tokens) at once
# took [rows, vocab] in float32 twice (the copy and its log-softmax): 2 GB for 2,048 rows of Llama 3's vocabulary, far
# more than the sampler's share of the memory the KV cache leaves (enginecore/cuda_setup.py), for one request's echo.
PROMPT_LOGPROB_ROWS = 256


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list:
    """Per row: [logprob of tokens[row], [[token_id, logprob], ...top tops[row]]], of the raw distribution."""
    entries: list = []
    for at in range(0, len(tokens), PROMPT_LOGPROB_ROWS):
        rows = slice(at, at + PROMPT_LOGPROB_ROWS)
        raw = torch.log_softmax(logits[rows].float(), dim=-1)
        entries += SampledTokens(to_device(tokens[rows], raw.device), raw, list(tops[rows])).result().logprobs
    return entries


def _logprob_entries(sampled: list[float], top_vals: list | None, top_ids: list | None, want: list[int | None]) -> list:
    """Per row: None where want is None, else [sampled logprob, [[token_id, logprob], ...top want[row]]]."""
    result: list = []
    for i, k in enumerate(want):
        if k is None:
            result.append(None)
            continue
        k = min(k, MAX_LOGPROBS)
        tops = [[top_ids[i][j], top_vals[i][j]] for j in range(k)] if k and top_ids and top_vals else []
        result.append([sampled[i], tops])
    return result
