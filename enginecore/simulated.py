"""A simulated engine: a BENCHMARK AND TEST INSTRUMENT, never the default engine.

`supervise --model sim:<itl_ms>` (e.g. `sim:10`: one step every 10 ms) builds this engine instead of loading a
model. It runs in the same process entry (enginecore.process), the same loop (enginecore.serve_loop) and with the
same request bookkeeping (enginecore.engine_base) as the real engine: only how tokens are made differs. It never
imports torch, so the API servers, the IPC and the supervisor can be measured and tested without the cost or the
noise of a forward pass.

What it "generates": every running sequence gets one token per step, cycling through the token ids of a fixed
sentence (with multi-byte characters, so detokenizers are exercised) that the embedded model's real tokenizer
decodes; after each full sentence comes EOS (the sentence's first token instead while a request ignores EOS or
still needs min_tokens). logprobs and prompt_logprobs are made up; a structured-output grammar is ignored (no
compiler, no mask: EngineBase's defaults). A step first waits for its tick (a fixed pace,
without drift): messages that come meanwhile wait for the next step (the serve loop's I/O thread takes them and
answers pings meanwhile), as during a real forward pass. The prompt costs
nothing: the first token comes one step after a request reaches an idle engine. No KV cache; like the real
engine, it runs at most --max-num-seqs sequences in a step and later requests wait their turn in arrival order
(reported as waiting), so an engine has a capacity, and data parallelism has something to scale (bench/dp.py).

Test hooks, documented because tests rely on them:
- a request whose id contains `sim-engine-die` makes the next step raise, as a real engine bug would: every API
  server hears ENGINE_DEAD and the process exits 1;
- a request whose id contains `sim-request-error` fails alone, as one the sampler cannot take does: its first step
  answers each of its choices with an error output (FinishReason.ERROR and a reason of many lines, as a library
  may write), and the engine carries on;
- a request whose id contains `sim-slow-step-<seconds>` (e.g. `sim-slow-step-4` or `sim-slow-step-2.5`) makes the
  next step take that much longer, as a long prefill chunk on a slow CPU would: the engine is busy, not dead;
- a request whose id contains `sim-engine-hang` makes the next step block forever (until SIGTERM), as a wedged
  forward pass would: the process lives, its step never ends;
- UTILITY `stats` reports counters (running, waiting, finished, aborted, failed) so a test can see aborts land.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from types import SimpleNamespace

from enginecore import model_facts
from enginecore.engine_base import BadEngineSetting, EngineBase, EngineLoad
from enginecore.sequence import Sequence, SequenceStatus
from ipc.config import ServeConfig
from ipc.messages import RequestOutput
from ipc.model_info import ModelInfo

log = logging.getLogger(__name__)

SIM_PREFIX = "sim:"
SENTENCE = (
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre, "
    "and its café culture — «la vie parisienne» 🥐. "
)
DIE_MARKER = "sim-engine-die"
REQUEST_ERROR_MARKER = "sim-request-error"
SLOW_STEP_MARKER = re.compile(r"sim-slow-step-(\d+(?:\.\d+)?)")
HANG_MARKER = "sim-engine-hang"
# REQUEST_ERROR_MARKER's reason: a first line, then pages of a library's internals (as llguidance appends its
# parser state and the whole grammar), which the API server keeps for its log.
SIMULATED_FAILURE = "simulated request failure\n<state>\n" + "internal state line\n" * 500 + "</state>"


def is_simulated(model: str | None) -> bool:
    return bool(model) and model.startswith(SIM_PREFIX)


def step_interval(model: str) -> float:
    """Seconds per step from `sim:<itl_ms>`; BadEngineSetting for anything else."""
    try:
        ms = float(model[len(SIM_PREFIX):])
    except ValueError:
        ms = 0.0
    if not ms > 0:
        raise BadEngineSetting(f"bad simulated model {model!r}: use sim:<milliseconds per step>")
    return ms / 1000.0


class SimulatedEngine(EngineBase):
    def __init__(self, config: ServeConfig):
        self.interval = step_interval(config.model or "")
        self.model_info, self.sentence_ids = load_model_info(config)
        info = self.model_info
        super().__init__(info.max_model_len, info.vocab_size, info.eos_token_ids, use_priority=False)
        self.max_num_seqs = config.max_num_seqs
        self.running: dict[int, Sequence] = {}  # by seq_id, in arrival order
        self.waiting: dict[int, Sequence] = {}  # first sequences of requests that do not fit yet, in arrival order
        self._next_tick: float | None = None  # monotonic time of the next step while anything runs
        self._doomed: str | None = None  # the DIE_MARKER request that makes the next step raise
        self._failing: list = []  # keys of REQUEST_ERROR_MARKER requests, failed by the next step
        self._stall = 0.0  # seconds the next step takes on top of its tick (SLOW_STEP_MARKER)
        self._hang: str | None = None  # the HANG_MARKER request that makes the next step block forever
        log.warning("SIMULATED engine (benchmark instrument, no model): one step every %.1f ms", self.interval * 1000)

    # --- how this engine schedules (up to --max-num-seqs at once, the rest in arrival order) ---------------
    def _schedule(self, seq: Sequence) -> None:
        if DIE_MARKER in seq.request_id:
            self._doomed = seq.request_id
        if REQUEST_ERROR_MARKER in seq.request_id:
            self._failing.append((seq.client, seq.request_id))
        slow = SLOW_STEP_MARKER.search(seq.request_id)
        if slow:
            self._stall += float(slow.group(1))
        if HANG_MARKER in seq.request_id:
            self._hang = seq.request_id
        self.waiting[seq.seq_id] = seq
        self._admit()

    def _admit(self) -> None:
        """Waiting requests start, in arrival order, while all their choices fit in --max-num-seqs (one that does
        not fit alone starts when nothing else runs)."""
        while self.waiting:
            seq = next(iter(self.waiting.values()))
            if self.running and len(self.running) + 1 + len(seq.pending_forks) > self.max_num_seqs:
                return
            del self.waiting[seq.seq_id]
            self._start(seq)

    def _start_fork(self, parent: Sequence, child: Sequence) -> bool:
        self._start(child)  # its place was counted when its parent was admitted
        return True

    def _start(self, seq: Sequence) -> None:
        if not self.running:
            self._next_tick = time.monotonic() + self.interval
        seq.status = SequenceStatus.RUNNING
        self.running[seq.seq_id] = seq

    def _release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.pop(seq.seq_id, None)
        self.waiting.pop(seq.seq_id, None)
        self._admit()

    def has_work(self) -> bool:
        return bool(self.running)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.running), len(self.waiting), 0.0)

    # --- how it makes tokens --------------------------------------------------------------------------------
    def step(self) -> list[tuple[bytes | None, RequestOutput]]:
        """Wait for the tick, then one token for every running sequence."""
        if self._doomed is not None:
            raise RuntimeError(f"simulated engine failure requested by {self._doomed!r}")
        now = time.monotonic()
        tick = self._next_tick if self._next_tick is not None else now
        if tick > now:
            time.sleep(tick - now)
        self._stall_if_asked()
        self.step_counts.steps += 1
        outputs = []
        for key in self._failing:
            if key in self.requests:  # not aborted meanwhile
                outputs += self.fail_request(key, SIMULATED_FAILURE)
        self._failing = []
        for seq in list(self.running.values()):
            if seq.pending_prompt_logprobs is not None and not seq.num_prompt_logprobs:
                top = seq.sampling.prompt_logprobs
                seq.pending_prompt_logprobs = [_made_up_logprobs(t, top) for t in seq.token_ids[1:]]
                seq.num_prompt_logprobs = seq.num_prompt_tokens - 1
            for s in (seq, *self._fork(seq)):
                token = self._next_token(s)
                logprobs = None if s.sampling.logprobs is None else _made_up_logprobs(token, s.sampling.logprobs)
                outputs.append(self._emit(s, token, logprobs))
        # A fixed pace, without drift, unless we fell more than a step behind.
        self._next_tick = max(tick + self.interval, time.monotonic()) if self.running else None
        return outputs

    def _stall_if_asked(self) -> None:
        if self._hang is not None:
            log.warning("this step blocks forever, as requested by %r", self._hang)
            while True:
                time.sleep(3600)
        if self._stall:
            stall, self._stall = self._stall, 0.0
            log.warning("this step takes %.1f s longer, as requested", stall)
            time.sleep(stall)

    def _next_token(self, seq: Sequence) -> int:
        position = seq.num_output_tokens
        offset = position % (len(self.sentence_ids) + 1)
        if offset < len(self.sentence_ids):
            return self.sentence_ids[offset]
        if seq.sampling.ignore_eos or position < seq.sampling.min_tokens:
            return self.sentence_ids[0]
        return self.eos_token_ids[0]


def _made_up_logprobs(token: int, top: int) -> list:
    """One token's logprobs entry in the RequestOutput shape: [its logprob, [[token_id, logprob], ...top]]."""
    return [-0.25, [[token, -0.25]] + [[token + k, -1.0 - k] for k in range(1, top)] if top else []]


def load_model_info(config: ServeConfig) -> tuple[ModelInfo, list[int]]:
    """The embedded model's ModelInfo (for its tokenizer) and the sentence's token ids. No torch: the cache exists
    after `make setup`, and resolve_model imports torch only when it has to convert."""
    from tokenizers import Tokenizer

    from enginecore.model_source import resolve_model

    model_dir = resolve_model(None)
    model_config = SimpleNamespace(**_read_json(os.path.join(model_dir, "config.json")))
    generation = SimpleNamespace(**_read_json(os.path.join(model_dir, "generation_config.json")))
    max_len = model_facts.model_context_len(model_config) or 2048
    info = ModelInfo(
        model_dir=model_dir,
        max_model_len=min(config.max_model_len or max_len, max_len),
        vocab_size=model_config.vocab_size,
        eos_token_ids=model_facts.eos_token_ids(model_config, generation),
        generation_defaults=model_facts.generation_defaults(model_dir),
        device="sim",
        dtype="none",
        block_size=config.block_size,
    )
    sentence_ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(
        SENTENCE, add_special_tokens=False
    ).ids
    return info, sentence_ids


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
