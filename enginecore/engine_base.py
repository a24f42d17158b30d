"""The engine's interface, as the serve loop (enginecore.serve_loop) drives it, and the request bookkeeping that
the real engine (enginecore.engine.EngineCore) and the simulated one (enginecore.simulated) share:

    add_request(request, client) -> outputs      queue a request; outputs only for one that ends at once
    abort(request_ids, client, indices) -> outputs   stop requests (or some of their choices): one 'abort' each
    abort_client(identity) -> int                stop every request of one API server (it died), silently
    step() -> [(client, output)]                 one step: a token for each sequence that got one
    has_work() -> bool                           anything waiting or running
    load() -> EngineLoad                         sent to the API servers with every batch of outputs
    stats(), reset_prefix_cache()                utility calls
    model_info                                   what the supervisor hands on to the API servers
    grammar_compiler                             compiles structured-output grammars (None: the engine takes
                                                 none); the serve loop compiles through it, off the loop

Each engine keeps only what differs: how sequences are scheduled and how their tokens are made (_schedule,
_start_fork, _release, _generator, _constrain, step, has_work, load). A request is keyed by (client, request_id):
two API servers may use the same request id. Its first sequence is choice 0; the other n-1 choices are forked from
it once its prompt is computed (until then they are its pending_forks).

Structured outputs: _add gives a constrained sequence its matcher (_constrain), Sequence.fork copies it to the
forked choices, _emit advances it by each token (a token it refuses fails that choice) and ends the choice with
'stop' once the grammar is complete; the step's mask is the real engine's (enginecore.structured_output).

A request the engine cannot take fails alone: one output per choice with finish reason "error" and the reason,
never an exception out of add_request. No torch here: the simulated engine never loads it.
"""
from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

from enginecore.request_check import BadRequest, check_request
from enginecore.sequence import Sequence
from enginecore.step_stats import StepCounts
from ipc.messages import EngineRequest, FinishReason, RequestOutput
from ipc.model_info import ModelInfo

log = logging.getLogger(__name__)

RequestKey = tuple  # (client, request_id)


class BadEngineSetting(Exception):
    """A setting the user gave cannot work (unknown dtype, no CUDA, a bad `sim:` spec, ...): reported as one line,
    exit code 2."""


class EngineLoad(NamedTuple):
    num_running: int
    num_waiting: int
    kv_cache_usage: float


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: seed + index, wrapped into a generator's range
    [0, 2**64) (seed 2**64-1 with n=2 is a valid request)."""
    return (seed + index) % 2**64


class EngineBase:
    model_info: ModelInfo
    grammar_compiler = None  # enginecore.grammar_compiler.GrammarCompiler where the engine takes grammars

    def __init__(self, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...], use_priority: bool):
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.use_priority = use_priority
        self.requests: dict[RequestKey, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_finished = self.num_aborted = self.num_failed = 0
        self.step_counts = StepCounts()  # for the log's line of activity (enginecore.step_stats)

    # --- what each engine does its own way ------------------------------------------------------------------
    def step(self) -> list[tuple[bytes | None, RequestOutput]]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def load(self) -> EngineLoad:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        return True

    def _schedule(self, seq: Sequence) -> None:
        """A new request's first sequence: it waits for its first step."""
        raise NotImplementedError

    def _start_fork(self, parent: Sequence, child: Sequence) -> bool:
        """child, just forked from parent at the end of its prompt: True if it runs at once, beside its parent;
        False if it waits for a slot of its own (it then computes its prompt's last tokens itself)."""
        raise NotImplementedError

    def _release(self, seq: Sequence) -> None:
        """seq is done (finished, aborted, failed): out of the schedule, whatever it held freed, status FINISHED."""
        raise NotImplementedError

    def _generator(self, seed: int):
        """A random generator seeded `seed` for one choice (None: the engine draws no random numbers)."""
        return None

    def _constrain(self, seq: Sequence) -> str | None:
        """seq's request has a grammar (sampling.grammar): give seq its matcher (seq.grammar), or say why it
        cannot have one. By default none: the simulated engine's tokens are its sentence's, grammar or not."""
        return None

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest, client: bytes | None = None) -> list[RequestOutput]:
        """Queue a request. Returns outputs at once only for one that does not run (finished or failed)."""
        try:
            check_request(request)
        except BadRequest as exc:
            log.warning("request %r failed: %s", request.request_id, exc)
            self.num_failed += 1
            return finished_at_once(request, FinishReason.ERROR, str(exc))
        key = (client, request.request_id)
        if key in self.requests:
            log.warning("request %s is already running: ignoring the duplicate", request.request_id)
            return []
        try:
            return self._add(key, request)
        except Exception as exc:  # an engine bug this request set off: it fails alone
            log.exception("request %s could not be added", request.request_id)
            self.requests.pop(key, None)
            self.num_failed += 1
            return finished_at_once(request, FinishReason.ERROR, one_line(exc))

    def _add(self, key: RequestKey, request: EngineRequest) -> list[RequestOutput]:
        p = request.sampling
        prompt = list(request.prompt_token_ids)
        reason = self._refusal(prompt, p)
        if reason is not None:
            log.warning("request %s finished at once: %s", request.request_id, reason[1])
            return finished_at_once(request, reason[0])
        if p.max_tokens == 0 and p.prompt_logprobs is None:  # nothing to compute (echo with max_tokens 0)
            return finished_at_once(request, FinishReason.LENGTH)
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=request.request_id, client=key[0], index=0,
            token_ids=prompt, num_prompt_tokens=len(prompt), sampling=p,
            priority=request.priority if self.use_priority else 0, arrival=next(self._arrivals),
            generator=self._choice_generator(p, 0), pending_forks=list(range(1, max(1, p.n))),
            pending_prompt_logprobs=None if p.prompt_logprobs is None else [], turn=request.ordinal,
        )
        if p.grammar is not None:
            error = self._constrain(seq)
            if error is not None:
                log.warning("request %s failed: %s", request.request_id, error)
                self.num_failed += 1
                return finished_at_once(request, FinishReason.ERROR, error)
        self.requests[key] = [seq]
        self._schedule(seq)
        return []

    def _refusal(self, prompt: list[int], p) -> tuple[str, str] | None:
        if not prompt:
            return FinishReason.ABORT, "empty prompt"
        if len(prompt) >= self.max_model_len:
            return FinishReason.LENGTH, f"prompt of {len(prompt)} tokens, the model allows {self.max_model_len}"
        if p.max_tokens < 0:
            return FinishReason.LENGTH, "max_tokens < 0"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return FinishReason.ABORT, "token id out of the vocabulary"
        return None

    def _choice_generator(self, p, index: int):
        return None if p.seed is None else self._generator(choice_seed(p.seed, index))

    def abort(self, request_ids: list[str], client: bytes | None = None,
              indices: list[int] | None = None) -> list[RequestOutput]:
        """Stop the requests' choices (only those of `indices` when given) and free what they held: one 'abort'
        output per choice stopped. A request is forgotten once none of its choices runs."""
        if not isinstance(request_ids, list) or not (indices is None or isinstance(indices, list)):
            log.warning("ignoring an abort of %r (indices %r): not lists", request_ids, indices)
            return []
        wanted = None if indices is None else {i for i in indices if isinstance(i, int)}
        outputs: list[RequestOutput] = []
        for request_id in request_ids:
            key = (client, request_id)
            if isinstance(request_id, str) and key in self.requests:
                outputs += self._abort_choices(key, wanted)
                if key not in self.requests:
                    self.num_aborted += 1
        return outputs

    def abort_client(self, identity: str) -> int:
        """Stop every request of the API server `identity` (e.g. "api-3", which died): nobody reads their outputs,
        so none is sent. Returns how many requests were stopped."""
        client = identity.encode()
        keys = [key for key in self.requests if key[0] == client]
        for key in keys:
            self._abort_choices(key, None)
        self.num_aborted += len(keys)
        if keys:
            log.info("aborted %d requests of %s", len(keys), identity)
        return len(keys)

    def _abort_choices(self, key: RequestKey, wanted: set[int] | None) -> list[RequestOutput]:
        outputs = []
        for seq in list(self.requests[key]):
            if seq.finished:
                continue
            stopped = [i for i in seq.pending_forks if wanted is None or i in wanted]
            seq.pending_forks = [i for i in seq.pending_forks if i not in stopped]
            outputs += [_choice_output(seq, i, FinishReason.ABORT) for i in stopped]
            if wanted is None or seq.index in wanted:
                outputs.append(_choice_output(seq, seq.index, FinishReason.ABORT))
                if seq.pending_forks:
                    # It has sent nothing yet: it carries on as the first choice it would have forked.
                    seq.index = seq.pending_forks.pop(0)
                    seq.generator = self._choice_generator(seq.sampling, seq.index)
                else:
                    self._release(seq)
        self._forget_if_done(key)
        return outputs

    def fail_request(self, key: RequestKey, reason: str) -> list[tuple[bytes | None, RequestOutput]]:
        """The engine cannot go on with this request (its sampling failed): every choice still running ends with
        an 'error' output; the others carry on."""
        log.warning("request %s failed: %s", key[1], reason)
        outputs = []
        for seq in self.requests.pop(key):
            indices = seq.pending_forks + ([] if seq.finished else [seq.index])
            seq.pending_forks = []
            if not seq.finished:
                self._release(seq)
            outputs += [(seq.client, _choice_output(seq, i, FinishReason.ERROR, reason)) for i in indices]
        self.num_failed += 1
        return outputs

    # --- a step's results -----------------------------------------------------------------------------------
    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The request's other choices, forked from its first one once its prompt is computed. Returns those that
        run at once (they sample their first token from their parent's logits, this step); the others wait."""
        if not parent.pending_forks:
            return []
        siblings = self.requests[(parent.client, parent.request_id)]
        children = []
        for index in parent.pending_forks:
            child = parent.fork(next(self._seq_ids), index, self._choice_generator(parent.sampling, index))
            siblings.append(child)
            if self._start_fork(parent, child):
                children.append(child)
        parent.pending_forks = []
        return children

    def _emit(self, seq: Sequence, token: int, logprobs, position: int | None = None) -> tuple[bytes | None, RequestOutput]:
        """seq's new token is `token`: put it in place, see whether seq is finished, and say so to its client.
        position: where it goes in seq.token_ids, on a placeholder the step left there (under asynchronous
        scheduling the next step's placeholder may follow it already); None: append it."""
        prompt_logprobs = seq.pending_prompt_logprobs
        if prompt_logprobs is not None:
            seq.pending_prompt_logprobs = None
        error = None
        if seq.sampling.max_tokens == 0:  # the prompt's logprobs only: no token
            new, token_logprobs, finish, stop = [], None, FinishReason.LENGTH, None
        elif seq.grammar is not None and not seq.grammar.accept(token):  # the grammar refuses it: this choice fails
            new, token_logprobs, finish, stop, error = [], None, FinishReason.ERROR, None, seq.grammar.error
            log.warning("request %s (choice %d) failed: %s", seq.request_id, seq.index, error)
        else:
            if position is None:
                position = seq.num_tokens
                seq.token_ids.append(token)
            else:
                seq.token_ids[position] = token
            finish, stop = self._finish_reason(seq, token, position + 1)
            self.step_counts.generated_tokens += 1
            new, token_logprobs = [token], [logprobs] if logprobs is not None else None
        output = RequestOutput(seq.request_id, new, seq.index, finish, stop, seq.num_prompt_tokens,
                               seq.num_cached_tokens, token_logprobs, prompt_logprobs, error)
        if finish is not None:
            self._release(seq)
            if self._forget_if_done((seq.client, seq.request_id)):
                self.num_finished += 1
        return seq.client, output

    def _finish_reason(self, seq: Sequence, token: int, num_tokens: int) -> tuple[str | None, int | None]:
        """Whether seq ends with `token`, its num_tokens-th token."""
        p = seq.sampling
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if token in seq.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP, None
        if seq.grammar is not None and seq.grammar.done:  # the constrained output is complete
            return FinishReason.STOP, None
        if num_output >= p.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _forget_if_done(self, key: RequestKey) -> bool:
        seqs = self.requests.get(key)
        if seqs is not None and all(s.finished and not s.pending_forks for s in seqs):
            del self.requests[key]
            return True
        return False

    # --- utilities ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        load = self.load()
        return {
            "num_running": load.num_running,
            "num_waiting": load.num_waiting,
            "kv_cache_usage": load.kv_cache_usage,
            "num_requests": len(self.requests),  # in flight
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_failed": self.num_failed,
        }

    def generate(self, requests: list[EngineRequest]) -> dict[tuple[str, int], list[int]]:
        """Run `requests` to completion (tests and benchmarks): {(request_id, index): output token ids}."""
        tokens: dict[tuple[str, int], list[int]] = {}
        for request in requests:
            for out in self.add_request(request):
                tokens.setdefault((out.request_id, out.index), [])
        while self.has_work():
            for _, out in self.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return tokens


def _choice_output(seq: Sequence, index: int, reason: str, error: str | None = None) -> RequestOutput:
    """Choice `index` of seq's request ends now, with no new token."""
    return RequestOutput(seq.request_id, [], index, reason, num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=seq.num_cached_tokens, error=error)


MAX_CHOICES_ANSWERED = 1024  # a hostile n must not make the answer huge: the API server fails on the first anyway


def finished_at_once(request: EngineRequest, reason: str, error: str | None = None) -> list[RequestOutput]:
    """One finished output, with no token, per choice of a request that runs no step (its fields may be of any
    type here: this also answers a request that failed its check)."""
    n = request.sampling.n
    num_choices = n if isinstance(n, int) and 1 < n <= MAX_CHOICES_ANSWERED else 1
    prompt = request.prompt_token_ids
    num_prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
    return [RequestOutput(request.request_id, [], i, reason, num_prompt_tokens=num_prompt_tokens, error=error)
            for i in range(num_choices)]


def one_line(exc: BaseException) -> str:
    """An exception as the one-line reason of a failed request."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())
