"""Grammars compiled off the step loop: the engine's compiler and cache, and the serve loop's requests that wait
for their grammar. No torch here (and no numpy): the serve loop imports this module, and it serves the simulated
engine too, which takes no grammars (EngineBase.grammar_compiler is None there: nothing is ever held).

- A request's grammar (SamplingParams.grammar, llguidance's JSON text: ipc/grammar.py) is compiled against the
  model's tokenizer once and cached by that text. The serve loop compiles it in a worker thread (llguidance drops
  the GIL while compiling) and admits the request when it is done, so a new grammar never stalls the step loop;
  in-process callers (tests, benchmarks) compile in add_request. The tokenizer's own index is built on the first
  grammar only: an engine that never sees one never pays for it.
- What a compiled grammar becomes in the engine (matchers, the step's mask) is enginecore/structured_output.py's.
"""
from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from enginecore.engine_base import finished_at_once
from enginecore.request_check import BadRequest, check_request
from ipc import grammar as grammars
from ipc.messages import FinishReason

log = logging.getLogger(__name__)

# Compiled grammars kept (--grammar-cache-size): most are tens of KB, but a schema near the API servers' check's
# limits (2,000 properties of one enum each) holds some 9 MB compiled, so the count bounds the memory: at 64, some
# 600 MB at the worst. And at most GRAMMAR_CACHE_TEXT_BYTES of grammar text in all: what a grammar holds compiled
# also grows with its text (a 2 MB one held some 6 MB), and one request body may bring 8 MiB of it.
GRAMMAR_CACHE_SIZE = 64
GRAMMAR_CACHE_TEXT_BYTES = 16 * 2**20
# The worker thread's stack: llguidance's compiler recurses along a grammar's chains of rules and $refs (some 8 KB
# a level), and a stack overflow kills the engine and its whole group. The API servers check every grammar with
# 2 MB (apiserver/grammar_checker_process.py), so what reaches an engine compiles here with room to spare.
COMPILE_STACK_BYTES = 64 << 20


class CompiledGrammar:
    """A grammar compiled against the tokenizer: the matcher every sequence copies, or why it failed."""

    __slots__ = ("matcher", "error", "text_bytes")

    def __init__(self, matcher=None, error: str | None = None, text_bytes: int = 0):
        self.matcher = matcher
        self.error = error
        self.text_bytes = text_bytes  # the length of its grammar's text, which the cache's budget counts


class GrammarCompiler:
    """Compiles grammars against the model's tokenizer, caches them by their text's digest (LRU, bounded in
    entries and in text), one worker thread."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._tokenizer_file = tokenizer_file
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # the cache and the tokenizer, shared with the worker
        # By the SHA-256 of the grammar's text: the text itself (megabytes, maybe) is not kept.
        self._cache: OrderedDict[bytes, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._cached_text_bytes = 0
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: dict[bytes, Future] = {}

    def cached(self, grammar: str) -> CompiledGrammar | None:
        key = _key(grammar)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, grammar: str) -> CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (in the caller's thread)."""
        compiled = self.cached(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
        return compiled

    def compile_later(self, grammar: str) -> Future:
        """A future of the compiled grammar, compiled in the worker thread (one future per grammar in flight)."""
        key = _key(grammar)
        future = self._in_flight.get(key)
        if future is None:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            future = self._submit(grammar)
            self._in_flight[key] = future
            future.add_done_callback(lambda _: self._in_flight.pop(key, None))
        return future

    def _submit(self, grammar: str) -> Future:
        """The compile queued on the worker, whose thread (started by its first submit) gets COMPILE_STACK_BYTES."""
        assert self._worker is not None
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            return self._worker.submit(self._compile, grammar)
        finally:
            threading.stack_size(previous)

    def _compile(self, grammar: str) -> CompiledGrammar:
        import llguidance

        try:
            # Errors without llguidance's parser state and the whole grammar: the API servers' check's limits.
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0, limits=grammars.parser_limits())
            error = grammars.short_reason(matcher.get_error()) if matcher.is_error() else None
            compiled = CompiledGrammar(None if error else matcher, error, len(grammar))
        except Exception as exc:  # a grammar llguidance refuses at the API level
            compiled = CompiledGrammar(None, grammars.short_reason(f"{type(exc).__name__}: {exc}"), len(grammar))
        if compiled.error:
            log.warning("a grammar does not compile: %s", compiled.error)
        self._keep(_key(grammar), compiled)
        return compiled

    def _keep(self, key: bytes, compiled: CompiledGrammar) -> None:
        """Cache `compiled`, then drop the least recently used grammars while the cache is past its bounds."""
        with self._lock:
            self._drop(key)
            self._cache[key] = compiled
            self._cached_text_bytes += compiled.text_bytes
            while len(self._cache) > 1 and (len(self._cache) > self._cache_size
                                            or self._cached_text_bytes > GRAMMAR_CACHE_TEXT_BYTES):
                self._drop(next(iter(self._cache)))

    def _drop(self, key: bytes) -> None:
        dropped = self._cache.pop(key, None)
        if dropped is not None:
            self._cached_text_bytes -= dropped.text_bytes

    def forget(self, grammar: str) -> None:
        """Drop `grammar`'s compiled matcher: one of its copies failed (a limit of llguidance's lexer, say). The
        copies share the lexer's state with it, so a later copy would find that state spent and allow nothing but
        EOS, an empty output that looks complete; compiled afresh, the grammar fails the same way again."""
        with self._lock:
            self._drop(_key(grammar))

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                with open(self._tokenizer_file) as f:
                    text = f.read()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self._vocab_size, eos_token=self._eos_token_ids)
            return self._tokenizer


def _key(grammar: str) -> bytes:
    return hashlib.sha256(grammar.encode()).digest()


class CompilingRequests:
    """The serve loop's requests whose grammar is still compiling in the worker thread: each goes to the engine
    once its grammar is compiled (then add_request finds it cached and starts at once), so the step loop never
    waits for a compile. A compile that finishes writes a byte to a socket the loop polls, so an idle loop
    wakes for it. With no compiler (an engine that takes no grammars) nothing is held."""

    def __init__(self, compiler: GrammarCompiler | None):
        self._compiler = compiler
        # (client, request_id) -> [request, future, choices aborted meanwhile], in arrival order
        self._waiting: dict[tuple, list] = {}
        self._wakeup, self._wakeup_write = socket.socketpair()
        self._wakeup.setblocking(False)

    def fileno(self) -> int:
        return self._wakeup.fileno()

    def hold(self, client: bytes, request) -> bool:
        """Keep `request` until its grammar is compiled; False when it can go to the engine now (so does one the
        engine cannot take: add_request fails it alone)."""
        grammar = request.sampling.grammar
        if grammar is None or self._compiler is None:
            return False
        try:
            check_request(request)
        except BadRequest:
            return False
        if self._compiler.cached(grammar) is not None:
            return False
        future = self._compiler.compile_later(grammar)
        future.add_done_callback(lambda _: self._wakeup_write.send(b"\0"))
        self._waiting[(client, request.request_id)] = [request, future, []]
        return True

    def ready(self) -> list[tuple[bytes, object, list[int]]]:
        """(client, request, its choices aborted while it waited) of every held request whose grammar is compiled
        now, in arrival order: the serve loop adds it to the engine, then aborts those choices there."""
        try:
            while self._wakeup.recv(4096):
                pass
        except BlockingIOError:
            pass
        ready = []
        for key in [key for key, (_, future, _) in self._waiting.items() if future.done()]:
            request, _, aborted = self._waiting.pop(key)
            ready.append((key[0], request, aborted))
        return ready

    def abort(self, client: bytes, request_ids: list[str], indices: list[int] | None = None) -> list:
        """Abort held requests: dropped, with an 'abort' output for each of their choices. Only some choices
        (`indices`): those are stopped once the request reaches the engine (ready() hands them on), as the engine
        stops a running request's choices."""
        outputs = []
        for request_id in request_ids if isinstance(request_ids, list) else ():
            key = (client, request_id)
            if not isinstance(request_id, str) or key not in self._waiting:
                continue
            if indices is None:
                outputs += finished_at_once(self._waiting.pop(key)[0], FinishReason.ABORT)
            elif isinstance(indices, list):
                self._waiting[key][2] += indices
        return outputs

    def drop_client(self, client: bytes) -> int:
        """Forget the held requests of an API server that is gone; how many."""
        keys = [key for key in self._waiting if key[0] == client]
        for key in keys:
            del self._waiting[key]
        return len(keys)
