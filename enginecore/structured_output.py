"""Structured outputs in the engine: one matcher per constrained sequence, and the step's token mask for the
sampler. Grammars are compiled (off the step loop, cached) by enginecore/grammar_compiler.py.

- Each constrained sequence holds a matcher (a copy of the compiled one: microseconds), advanced by every token it
  accepts; a forked choice copies its parent's. Preemption keeps a sequence's tokens (it recomputes their KV), so
  its matcher stays in step; should a sequence ever hold fewer tokens than its matcher took, `sync` rolls the
  matcher back to them.
- A step's mask covers only its constrained rows: a packed bitmask filled by the matchers, unpacked and applied
  to those rows of the logits before anything else in the sampler, so logprobs are those of the masked
  distribution. It goes into the sampler's own copy of the logits: a batch sampled again row by row (one row
  raised) starts from the same logits, each constrained row under its own row of the mask (TokenMask.row). A
  step without constrained sequences checks one empty set and does nothing else. On CUDA the logits come out of
  the (possibly graph-replayed) forward pass and the mask is applied after it, outside any captured graph, like
  the rest of the sampler.
- Once a matcher can take nothing more (the JSON value closed), its sequence finishes with 'stop' at once, without
  spending a step on the EOS token the grammar would force.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import numpy as np
import torch

from enginecore.grammar_compiler import GRAMMAR_CACHE_SIZE, GrammarCompiler
from enginecore.host_to_device import to_device
from ipc import grammar as grammars


class GrammarState:
    """One sequence's matcher and how many of its output tokens it has taken; `on_error` is called once the
    matcher fails (GrammarCompiler.forget: its compiled grammar is not to be copied again)."""

    __slots__ = ("matcher", "num_tokens", "on_error")

    def __init__(self, matcher, num_tokens: int = 0, on_error: Callable[[], None] | None = None):
        self.matcher = matcher
        self.num_tokens = num_tokens
        self.on_error = on_error

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.num_tokens, self.on_error)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False when the matcher is in error: it refused the token, or it failed
        before (a mask that hit one of llguidance's limits, or a grammar that allows nothing: a matcher in error
        allows only EOS, and takes it, so without this check such an output would end as a complete one)."""
        self.num_tokens += 1
        if self.matcher.consume_token(token) and not self.matcher.is_error():
            return True
        if self.on_error is not None:
            self.on_error()
        return False

    def sync(self, num_output_tokens: int) -> None:
        """Roll back tokens the sequence no longer holds."""
        if num_output_tokens < self.num_tokens:
            self.matcher.rollback(self.num_tokens - num_output_tokens)
            self.num_tokens = num_output_tokens

    @property
    def done(self) -> bool:
        """Nothing more can follow (but EOS): the constrained output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        reason = self.matcher.get_error()
        return grammars.engine_error(f"failed: {grammars.short_reason(reason)}" if reason else "refused the sampled token")


class TokenMask:
    """The allowed tokens of a step's constrained rows: `rows` of the logits, one packed bit per token id."""

    __slots__ = ("rows", "bits", "vocab_size")

    def __init__(self, rows: list[int], bits: np.ndarray, vocab_size: int):
        self.rows = rows
        self.bits = bits
        self.vocab_size = vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of every refused token of the constrained rows to -inf, in place."""
        barred = self._barred(logits.device)
        if len(self.rows) == logits.shape[0]:
            logits.masked_fill_(barred, float("-inf"))
            return
        rows = to_device(self.rows, logits.device)
        logits[rows] = logits[rows].masked_fill_(barred, float("-inf"))

    def row(self, i: int) -> TokenMask | None:
        """Row i's mask alone, for that row sampled as a batch of one (None: row i is not constrained)."""
        if i not in self.rows:
            return None
        k = self.rows.index(i)
        return TokenMask([0], self.bits[k:k + 1], self.vocab_size)

    def _barred(self, device: torch.device) -> torch.Tensor:
        """[rows, vocab] bools, True for each token a row's grammar refuses."""
        if device.type == "cpu":
            return self.barred_on_cpu()
        return self.barred_on(device)

    def barred_on_cpu(self) -> torch.Tensor:
        # numpy unpacks bits several times faster than torch's shifts on the CPU; unpacking the inverted bits
        # gives the barred tokens as 0/1 bytes, which torch takes as bools without a copy.
        barred = np.unpackbits(~self.bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(barred).view(torch.bool)

    def barred_on(self, device: torch.device) -> torch.Tensor:
        # On an accelerator: the packed words go over (32x fewer bytes) and are unpacked there.
        words = torch.from_numpy(self.bits).to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :self.vocab_size] == 0


class StructuredOutputs:
    """The engine's side: matchers for new sequences, the step's mask, the accepted tokens."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.compiler = GrammarCompiler(tokenizer_file, vocab_size, eos_token_ids, cache_size)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = np.empty((0, self._words), dtype=np.int32)  # reused while large enough
        # Constrained sequences alive: a step checks this one set, so without any it pays nothing more.
        self._live: weakref.WeakSet = weakref.WeakSet()

    def start(self, seq) -> str | None:
        """Give a new sequence its matcher (compiling its grammar now if no one has yet); the error otherwise."""
        grammar = seq.sampling.grammar
        compiled = self.compiler.compile(grammar)
        if compiled.error is not None:
            return grammars.engine_error(f"does not compile: {compiled.error}")
        seq.grammar = GrammarState(compiled.matcher.deep_copy(), on_error=functools.partial(self.compiler.forget, grammar))
        self._live.add(seq)
        return None

    def forked(self, child) -> None:
        self._live.add(child)

    def mask(self, seqs: list) -> TokenMask | None:
        """The step's mask over `seqs` (the sampler's rows), None when none of them is constrained."""
        if not self._live:
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        if self._bits.shape[0] < len(rows):
            self._bits = np.empty((max(len(rows), 2 * self._bits.shape[0]), self._words), dtype=np.int32)
        bits = self._bits[:len(rows)]
        nbytes = self._words * 4
        for k, i in enumerate(rows):
            seq = seqs[i]
            seq.grammar.sync(seq.num_output_tokens)
            seq.grammar.matcher.unsafe_compute_mask_ptr(bits[k].ctypes.data, nbytes)
        return TokenMask(rows, bits, self.vocab_size)
