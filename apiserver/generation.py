"""One API request's generation: its engine requests (one per prompt, each with n sequences) and the text,
token count and finish of each OpenAI choice, updated batch by batch as the engine's outputs arrive.

Both endpoints, streaming or not, drive a Generation the same way (apiserver/generation_run.py): `start()`,
`await next_changes()` until `done`, `take(changed)` for what the choices have to tell (the chunk writers only
format it), then `close()`, which aborts in the engine whatever is still running there. A choice that a stop
string ends while its request goes on is aborted in the engine at once.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import NamedTuple

from apiserver.detokenizer import IncrementalDetokenizer
from apiserver.engine_client import EngineClient
from apiserver.engine_errors import RequestAborted, request_error
from apiserver.request_stream import RequestStream
from apiserver.stop_strings import StopStrings
from ipc.messages import FinishReason
from ipc.sampling import SamplingParams

# Engine request ids must be unique in the engine even when clients reuse an X-Request-Id: a per-process
# random prefix and a counter make them so, across API servers and restarts.
_PROCESS_TAG = os.urandom(4).hex()
_COUNTER = itertools.count()


class Delta(NamedTuple):
    """What one choice has to tell since its last delta, for a chunk writer to format as it is."""

    index: int
    prompt_index: int
    text: str
    logprobs: list | None  # (token id, [logprob, top]) per new token; None when not asked for
    prompt_logprobs: list | None  # the prompt's entries, once (echo with logprobs)
    finish_reason: str | None
    stop_reason: int | str | None


# Per streamed token: tuple.__new__ makes the same Delta without the Python-level __new__ (half the cost).
_new_delta = tuple.__new__


class Choice:
    __slots__ = (
        "index", "prompt_index", "detokenizer", "num_tokens", "finish_reason", "stop_reason",
        "logprobs", "prompt_logprobs", "_changed",
    )

    def __init__(self, index: int, prompt_index: int, detokenizer: IncrementalDetokenizer, want_logprobs: bool):
        self.index = index
        self.prompt_index = prompt_index
        self.detokenizer = detokenizer
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Per token: (token id, [sampled logprob, [[id, logprob], ...]]), not yet handed out.
        self.logprobs: list | None = [] if want_logprobs else None
        # With prompt logprobs, once they arrive: per prompt token (token id, [logprob, [[id, logprob], ...]]),
        # the first token's data None. The same list for every choice of one prompt.
        self.prompt_logprobs: list | None = None
        self._changed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        priority: int,
        stop: StopStrings,
        skip_special_tokens: bool,
        include_stop_str_in_output: bool,
        tokenizer,
        rank: int | None = None,
        grammar_param: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        """`rank`: the data-parallel rank to run on (X-data-parallel-rank); None: the least loaded.
        `grammar_param`: the request's field that gave sampling.grammar, named by a 400 if it fails in the engine.
        `eos_token_ids`: the model's (ModelInfo.eos_token_ids)."""
        self._engine = engine
        self.request_id = request_id
        self.grammar_param = grammar_param
        self._rank = rank
        self.prompts = prompts
        self.sampling = sampling
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.num_cached_tokens = 0
        n = sampling.n
        tag = f"{request_id}-{_PROCESS_TAG}{next(_COUNTER)}"
        self._engine_ids = [tag] if len(prompts) == 1 else [f"{tag}-{i}" for i in range(len(prompts))]
        self._first_choice = {rid: i * n for i, rid in enumerate(self._engine_ids)}
        want_logprobs = sampling.logprobs is not None
        self.choices = [
            Choice(
                i * n + j,
                i,
                IncrementalDetokenizer(tokenizer, prompt, stop, skip_special_tokens, include_stop_str_in_output,
                                       sampling.min_tokens),
                want_logprobs,
            )
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        self._unfinished = len(self.choices)
        # The token that ended a sequence (an EOS, one of stop_token_ids) counts but is not shown, as in vLLM,
        # unless include_stop_str_in_output: with skip_special_tokens false `<|im_end|>` ended every answer.
        self._hide_stop_token = not include_stop_str_in_output
        self._eos_token_ids = eos_token_ids
        self._stop_strings = bool(stop)
        self._priority = priority
        self._stream: RequestStream | None = None
        self.arrival = time.monotonic()
        self.first_output_at: float | None = None

    def _ended_by_its_token(self, out) -> bool:
        """Whether the engine ended this sequence at its last token: one of stop_token_ids (the engine gives it as
        the stop reason) or an EOS (no reason; a grammar that completes on another token ends it too)."""
        if out.finish_reason != FinishReason.STOP or not out.new_token_ids:
            return False
        return isinstance(out.stop_reason, int) or out.new_token_ids[-1] in self._eos_token_ids

    @property
    def pushable(self) -> bool:
        """Whether an output that does not end a sequence can never end a choice here either (no stop strings):
        such outputs may be applied as they arrive, by `push_to`'s handler, and only the engine's ends come
        back through `next_changes`."""
        return not self._stop_strings

    def push_to(self, handler) -> None:
        """While this generation's consumer waits in `next_changes`, its outputs that end no sequence go to
        `handler(outputs) -> bool` instead (RequestStream.handler); the ones it declines come back as before."""
        self._stream.handler = handler

    def fail(self, error: BaseException) -> None:
        """The consumer's `next_changes` raises `error` (a handler's failure, told where it is handled)."""
        if self._stream is not None:
            self._stream.fail(error)

    def start(self) -> None:
        self._stream = self._engine.generate(
            list(zip(self._engine_ids, self.prompts)), self.sampling, self._priority, self._rank
        )

    @property
    def ranks(self) -> list[int]:
        """The data-parallel rank of each engine request, once started."""
        return self._engine.ranks_of(self._stream)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    @property
    def unfinished_reason(self) -> str:
        """What /metrics counts a choice that did not finish as: `error` when the server ended the request (an
        engine gone, the stop's deadline), `abort` when its client did."""
        stream = self._stream
        return FinishReason.ERROR if stream is not None and stream.ended_by_the_server else FinishReason.ABORT

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    async def next_changes(self, timeout: float | None = None) -> list[Choice]:
        """The choices that changed with the next engine outputs ([] when `timeout` passed without any).
        Raises EngineDeadError, RequestAborted when the client went away, or EngineRequestError."""
        return self.apply(await self._stream.next_batch(timeout))

    def apply(self, outputs: list) -> list[Choice]:
        """The choices these engine outputs changed, updated (what `next_changes` does once they are here)."""
        if self.first_output_at is None and outputs:
            self.first_output_at = time.monotonic()
        choices = self.choices
        first = self._first_choice
        changed = []
        stopped = None
        for out in outputs:
            if out.prompt_logprobs is not None:  # sent with choice 0 only: it belongs to all n
                self._set_prompt_logprobs(first[out.request_id], out.prompt_logprobs)
            choice = choices[first[out.request_id] + out.index]
            if choice.finish_reason is not None:
                continue  # a stop string ended it here; the engine had not heard yet
            if out.finish_reason == FinishReason.ERROR:
                choice.finish_reason = FinishReason.ERROR
                self._unfinished -= 1
                raise request_error(out, self.grammar_param)
            new = out.new_token_ids
            if out.num_cached_tokens and choice.num_tokens == 0 and choice.index % self.sampling.n == 0:
                self.num_cached_tokens += out.num_cached_tokens
            shown = new[:-1] if self._hide_stop_token and self._ended_by_its_token(out) else new
            used = choice.detokenizer.add_tokens(shown)
            if choice.detokenizer.stop_reason is None:
                used = len(new)  # the unshown stop token too
            choice.num_tokens += used
            if choice.logprobs is not None and out.logprobs:
                choice.logprobs.extend(zip(new[:used], out.logprobs[:used]))
            if choice.detokenizer.stop_reason is not None:
                choice.finish_reason, choice.stop_reason = FinishReason.STOP, choice.detokenizer.stop_reason
                if out.finish_reason is None:  # the engine would go on decoding it
                    stopped = stopped or []
                    stopped.append(choice)
            elif out.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            if choice.finish_reason is not None:
                self._unfinished -= 1
            if not choice._changed:
                choice._changed = True
                changed.append(choice)
        for choice in changed:
            choice._changed = False
        if stopped and self._unfinished:  # (when all are done, close() aborts what runs)
            self._abort_in_engine(stopped)
        return changed

    def take(self, changed: list[Choice]) -> list[Delta]:
        """What `changed` choices have not handed out yet: their text (minus what may still become a stop
        string, unless the choice finished), their new logprobs, their prompt logprobs once."""
        deltas = []
        for choice in changed:
            logprobs = choice.logprobs
            if logprobs is not None:
                choice.logprobs = []
            prompt_logprobs = choice.prompt_logprobs
            choice.prompt_logprobs = None
            finish = choice.finish_reason
            text = choice.detokenizer.take_delta(finish is not None)
            deltas.append(_new_delta(Delta, (choice.index, choice.prompt_index, text, logprobs, prompt_logprobs,
                                             finish, choice.stop_reason)))
        return deltas

    def _abort_in_engine(self, stopped: list[Choice]) -> None:
        """Stop decoding the choices a stop string ended: only them while their engine request has others
        running, else the whole engine request."""
        n = self.sampling.n
        indices_of: dict[int, list[int]] = {}
        for choice in stopped:
            indices_of.setdefault(choice.prompt_index, []).append(choice.index - choice.prompt_index * n)
        for prompt_index, indices in indices_of.items():
            siblings = self.choices[prompt_index * n:(prompt_index + 1) * n]
            whole = all(c.finish_reason is not None for c in siblings)
            self._engine.abort(self._stream, self._engine_ids[prompt_index], None if whole else indices)

    def _set_prompt_logprobs(self, first_choice: int, entries: list) -> None:
        n = self.sampling.n
        prompt = self.prompts[first_choice // n]
        per_token = [(prompt[0], None)] + list(zip(prompt[1:], entries))
        for choice in self.choices[first_choice:first_choice + n]:
            choice.prompt_logprobs = per_token

    def abort(self) -> None:
        """The client went away: whoever waits on the next outputs gets RequestAborted."""
        self.fail(RequestAborted())

    def close(self) -> None:
        if self._stream is not None:
            self._engine.release(self._stream)
            self._stream = None
