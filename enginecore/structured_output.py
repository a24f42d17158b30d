"""Structured outputs in the engine: grammars compiled off the step loop and cached, one matcher per constrained
sequence, and the step's token mask for the sampler.

- A request's grammar (SamplingParams.grammar, llguidance's JSON text: ipc/grammar.py) is compiled against the
  model's tokenizer once and cached by that text. The serve loop compiles it in a worker thread (llguidance drops
  the GIL while compiling) and admits the request when it is done, so a new grammar never stalls the step loop;
  in-process callers (tests, benchmarks) compile in add_request. The tokenizer's own index is built on the first
  grammar only: an engine that never sees one never pays for it.
- Each constrained sequence holds a matcher (a copy of the compiled one: microseconds), advanced by every token it
  accepts; a forked choice copies its parent's. Preemption keeps a sequence's tokens (it recomputes their KV), so
  its matcher stays in step; should a sequence ever hold fewer tokens than its matcher took, `sync` rolls the
  matcher back to them.
- A step's mask covers only its constrained rows: a packed bitmask filled by the matchers, unpacked and applied
  to those rows of the logits before anything else in the sampler, so logprobs are those of the masked
  distribution. A step without constrained sequences checks one empty set and does nothing else. On CUDA the
  logits come out of the (possibly graph-replayed) forward pass and the mask is applied after it, outside any
  captured graph, like the rest of the sampler.
- Once a matcher can take nothing more (the JSON value closed), its sequence finishes with 'stop' at once, without
  spending a step on the EOS token the grammar would force.
"""
from __future__ import annotations

import logging
import socket
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from ipc.messages import FinishReason, RequestOutput

import numpy as np
import torch

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 512  # compiled grammars kept (a compiled JSON schema is tens of KB)


class CompiledGrammar:
    """A grammar compiled against the tokenizer: the matcher every sequence copies, or why it failed."""

    __slots__ = ("matcher", "error")

    def __init__(self, matcher=None, error: str | None = None):
        self.matcher = matcher
        self.error = error


class GrammarCompiler:
    """Compiles grammars against the model's tokenizer, caches them by their text (LRU), one worker thread."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer_file = tokenizer_file
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # the cache and the tokenizer, shared with the worker
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: dict[str, Future] = {}

    def cached(self, grammar: str) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
            return compiled

    def compile(self, grammar: str) -> CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (in the caller's thread)."""
        compiled = self.cached(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
        return compiled

    def compile_later(self, grammar: str) -> Future:
        """A future of the compiled grammar, compiled in the worker thread (one future per grammar in flight)."""
        future = self._in_flight.get(grammar)
        if future is None:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            future = self._worker.submit(self._compile, grammar)
            self._in_flight[grammar] = future
            future.add_done_callback(lambda _: self._in_flight.pop(grammar, None))
        return future

    def _compile(self, grammar: str) -> CompiledGrammar:
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else None
            compiled = CompiledGrammar(None if error else matcher, error)
        except Exception as exc:  # a grammar llguidance refuses at the API level
            compiled = CompiledGrammar(None, f"{type(exc).__name__}: {exc}")
        if compiled.error:
            log.warning("a grammar does not compile: %s", compiled.error)
        with self._lock:
            self._cache[grammar] = compiled
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                with open(self._tokenizer_file) as f:
                    text = f.read()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self._vocab_size, eos_token=self._eos_token_ids)
            return self._tokenizer


class GrammarState:
    """One sequence's matcher and how many of its output tokens it has taken."""

    __slots__ = ("matcher", "num_tokens")

    def __init__(self, matcher, num_tokens: int = 0):
        self.matcher = matcher
        self.num_tokens = num_tokens

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.num_tokens)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False when the grammar refuses it (the matcher is then in error)."""
        self.num_tokens += 1
        return self.matcher.consume_token(token)

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
        return self.matcher.get_error() or "the grammar refused the sampled token"


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
        rows = torch.tensor(self.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill_(barred, float("-inf"))

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

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.compiler = GrammarCompiler(tokenizer_file, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = np.empty((0, self._words), dtype=np.int32)  # reused while large enough
        # Constrained sequences alive: a step checks this one set, so without any it pays nothing more.
        self._live: weakref.WeakSet = weakref.WeakSet()

    def start(self, seq) -> str | None:
        """Give a new sequence its matcher (compiling its grammar now if no one has yet); the error otherwise."""
        compiled = self.compiler.compile(seq.sampling.grammar)
        if compiled.error is not None:
            return f"the structured output grammar does not compile: {compiled.error}"
        seq.grammar = GrammarState(compiled.matcher.deep_copy())
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


class CompilingRequests:
    """The serve loop's requests whose grammar is still compiling in the worker thread: each goes to the engine
    once its grammar is compiled (then add_request finds it cached and starts at once), so the step loop never
    waits for a compile. A compile that finishes writes a byte to a socket the loop polls, so an idle loop
    wakes for it."""

    def __init__(self, compiler: GrammarCompiler):
        self._compiler = compiler
        self._waiting: dict[tuple, tuple] = {}  # (client, request_id) -> (request, future), in arrival order
        self._wakeup, self._wakeup_write = socket.socketpair()
        self._wakeup.setblocking(False)

    def fileno(self) -> int:
        return self._wakeup.fileno()

    def hold(self, client: bytes, request) -> bool:
        """Keep `request` until its grammar is compiled; False when it can go to the engine now."""
        grammar = request.sampling.grammar
        if grammar is None or self._compiler.cached(grammar) is not None:
            return False
        future = self._compiler.compile_later(grammar)
        future.add_done_callback(lambda _: self._wakeup_write.send(b"\0"))
        self._waiting[(client, request.request_id)] = (request, future)
        return True

    def ready(self) -> list[tuple[bytes, object]]:
        """(client, request) of every held request whose grammar is compiled now, in arrival order."""
        try:
            while self._wakeup.recv(4096):
                pass
        except BlockingIOError:
            pass
        done = [(key, request) for key, (request, future) in self._waiting.items() if future.done()]
        for key, _ in done:
            del self._waiting[key]
        return [(key[0], request) for key, request in done]

    def abort(self, client: bytes, request_ids: list[str]) -> list:
        """Drop held requests: an 'abort' output for each of their choices."""
        outputs = []
        for request_id in request_ids:
            held = self._waiting.pop((client, request_id), None)
            if held is not None:
                request = held[0]
                outputs += [RequestOutput(request_id, [], i, FinishReason.ABORT,
                                          num_prompt_tokens=len(request.prompt_token_ids))
                            for i in range(max(1, request.sampling.n))]
        return outputs

    def drop_client(self, client: bytes) -> int:
        """Forget the held requests of an API server that is gone; how many."""
        keys = [key for key in self._waiting if key[0] == client]
        for key in keys:
            del self._waiting[key]
        return len(keys)
