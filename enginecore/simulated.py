"""A simulated engine core: a BENCHMARK AND TEST INSTRUMENT, never the default engine.

`supervise --model sim:<itl_ms>` starts this instead of the real engine (e.g. `sim:10`: one step every 10 ms).
It has no model and never imports torch, yet it speaks the real IPC protocol exactly like
enginecore/process.py (same CONTRACT, same ROUTER socket, ADD / ABORT / UTILITY in, one EngineOutputs per step
and API server out, ENGINE_DEAD when its loop raises), so the API servers and the supervisor can be measured
and tested without the cost or the noise of a forward pass: what is left is the overhead of everything else.

What it "generates": every running sequence gets one token per step, cycling through the token ids of a fixed
sentence (with multi-byte characters, so detokenizers are exercised) that the embedded model's real tokenizer
decodes. It honours max_tokens (0: no token, only the prompt logprobs), ignore_eos (else EOS after the sentence),
min_tokens, stop_token_ids, n, logprobs and prompt_logprobs (made-up values) and abort. The prompt costs nothing:
the first token comes one step after arrival.

Test hooks, documented because tests rely on them:
- a request whose id contains `sim-engine-die` makes the loop raise, as a real engine bug would: every API
  server hears ENGINE_DEAD and the process exits 1;
- a request whose id contains `sim-request-error` fails alone: its first step answers each of its choices with
  an error output (FinishReason.ERROR and a reason), and the engine carries on;
- UTILITY `stats` reports counters (running, waiting, finished, aborted) so a test can see aborts land.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import zmq

from ipc import codec
from ipc.config import ServeConfig
from ipc.launch import EngineLaunch
from ipc.lifeline import die_with_parent
from ipc.logs import setup_logging
from ipc.messages import (
    AbortRequests,
    EngineDead,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    RequestOutput,
    UtilityCall,
    UtilityResult,
)
from ipc.model_info import EngineFailed, EngineReady, ModelInfo
from ipc.sockets import bind_router, engine_address

log = logging.getLogger(__name__)

SIM_PREFIX = "sim:"
SENTENCE = (
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre, "
    "and its café culture — «la vie parisienne» 🥐. "
)
DIE_MARKER = "sim-engine-die"
REQUEST_ERROR_MARKER = "sim-request-error"
# Sampling keys of generation_config.json that the API servers use as defaults.
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def is_simulated(model: str | None) -> bool:
    return bool(model) and model.startswith(SIM_PREFIX)


def step_interval(model: str) -> float:
    """Seconds per step from `sim:<itl_ms>`; ValueError for anything else."""
    ms = float(model[len(SIM_PREFIX):])
    if not ms > 0:
        raise ValueError("the step interval must be positive")
    return ms / 1000.0


@dataclass
class _Sequence:
    index: int
    position: int = 0  # tokens emitted so far
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class _Request:
    identity: bytes
    request: EngineRequest
    sequences: list[_Sequence] = field(default_factory=list)


class SimulatedEngine:
    """The step loop's state: running requests, their owners, and what one step emits."""

    def __init__(self, sentence_ids: list[int], eos_token_id: int, max_model_len: int):
        self.sentence_ids = sentence_ids
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.running: dict[str, _Request] = {}
        self.identities: set[bytes] = set()
        self.num_finished = 0
        self.num_aborted = 0
        self.num_requests = 0

    def add(self, identity: bytes, request: EngineRequest) -> None:
        if DIE_MARKER in request.request_id:
            raise RuntimeError(f"simulated engine failure requested by {request.request_id!r}")
        n = max(1, request.sampling.n)
        self.running[request.request_id] = _Request(identity, request, [_Sequence(i) for i in range(n)])
        self.num_requests += 1

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.running.pop(request_id, None) is not None:
                self.num_aborted += 1

    def abort_client(self, identity: str) -> int:
        """Abort every request of one API server (the supervisor calls this when that server is gone): the count."""
        owner = identity.encode()
        request_ids = [request_id for request_id, req in self.running.items() if req.identity == owner]
        self.abort(request_ids)
        return len(request_ids)

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": 0,
            "num_requests": self.num_requests,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "kv_cache_usage": 0.0,
        }

    def step(self) -> dict[bytes, list[RequestOutput]]:
        """One token for every running sequence, grouped by the API server that owns each request."""
        outputs: dict[bytes, list[RequestOutput]] = {}
        for request_id, req in list(self.running.items()):
            sampling = req.request.sampling
            prompt_len = len(req.request.prompt_token_ids)
            for seq in req.sequences:
                if seq.finish_reason is not None:
                    continue
                prompt_logprobs = None
                if sampling.prompt_logprobs is not None and seq.position == 0 and seq.index == 0:
                    prompt_logprobs = [_made_up_logprobs(t, sampling.prompt_logprobs)[0]
                                       for t in req.request.prompt_token_ids[1:]]
                if sampling.max_tokens == 0:
                    seq.finish_reason = FinishReason.LENGTH
                    outputs.setdefault(req.identity, []).append(RequestOutput(
                        request_id, [], seq.index, seq.finish_reason, num_prompt_tokens=prompt_len,
                        prompt_logprobs=prompt_logprobs))
                    continue
                if REQUEST_ERROR_MARKER in request_id:
                    seq.finish_reason = FinishReason.ERROR
                    outputs.setdefault(req.identity, []).append(RequestOutput(
                        request_id, [], seq.index, seq.finish_reason, error="simulated request failure"))
                    continue
                token = self._next_token(seq, sampling)
                seq.position += 1
                if seq.position >= sampling.min_tokens:
                    if token == self.eos_token_id and not sampling.ignore_eos:
                        seq.finish_reason = FinishReason.STOP
                    elif token in sampling.stop_token_ids:
                        seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
                if seq.finish_reason is None and (
                    seq.position >= sampling.max_tokens or prompt_len + seq.position >= self.max_model_len
                ):
                    seq.finish_reason = FinishReason.LENGTH
                outputs.setdefault(req.identity, []).append(
                    RequestOutput(
                        request_id=request_id,
                        new_token_ids=[token],
                        index=seq.index,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                        num_prompt_tokens=prompt_len,
                        logprobs=_made_up_logprobs(token, sampling.logprobs),
                        prompt_logprobs=prompt_logprobs,
                    )
                )
            if all(seq.finish_reason is not None for seq in req.sequences):
                del self.running[request_id]
                self.num_finished += 1
        return outputs

    def _next_token(self, seq: _Sequence, sampling) -> int:
        # After each full sentence comes EOS, unless the request ignores EOS or still needs min_tokens.
        cycle = len(self.sentence_ids) + 1
        offset = seq.position % cycle
        if offset < len(self.sentence_ids):
            return self.sentence_ids[offset]
        if sampling.ignore_eos or seq.position < sampling.min_tokens:
            return self.sentence_ids[0]
        return self.eos_token_id


def _made_up_logprobs(token: int, top: int | None) -> list | None:
    if top is None:
        return None
    return [[-0.25, [[token, -0.25]] + [[token + k, -1.0 - k] for k in range(1, top)]]]


def load_model_info(config: ServeConfig) -> tuple[ModelInfo, list[int]]:
    """The embedded model's ModelInfo (for its tokenizer) and the sentence's token ids. No torch: the cache
    exists after `make setup`, and resolve_model imports torch only when it has to convert."""
    from tokenizers import Tokenizer

    from enginecore.model_source import resolve_model

    model_dir = resolve_model(None)
    with open(os.path.join(model_dir, "config.json")) as f:
        model_config = json.load(f)
    generation = {}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            generation = json.load(f)
    eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    max_len = model_config.get("max_position_embeddings", 2048)
    info = ModelInfo(
        model_dir=model_dir,
        max_model_len=min(config.max_model_len or max_len, max_len),
        vocab_size=model_config["vocab_size"],
        eos_token_ids=eos_ids,
        generation_defaults={k: generation[k] for k in _SAMPLING_DEFAULT_KEYS if k in generation},
        device="sim",
        dtype="none",
        block_size=config.block_size,
    )
    sentence_ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(
        SENTENCE, add_special_tokens=False
    ).ids
    return info, sentence_ids


def run_simulated_engine_core(launch: EngineLaunch) -> None:
    """Same CONTRACT as enginecore.process.run_engine_core, for `--model sim:<itl_ms>`."""
    config, rank, ready, lifeline = launch.config, launch.rank, launch.ready, launch.lifeline
    try:
        from setproctitle import setproctitle

        setproctitle(f"supervise: EngineCore_DP{rank}")
    except ImportError:
        pass
    setup_logging(f"EngineCore_DP{rank}", config.log_level)
    die_with_parent(lifeline)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))

    try:
        interval = step_interval(config.model or "")
    except ValueError:
        ready.send(EngineFailed(rank, f"bad simulated model {config.model!r}: use sim:<milliseconds per step>", True))
        return
    try:
        info, sentence_ids = load_model_info(config)
        ctx = zmq.Context()
        router = bind_router(ctx, engine_address(config.runtime_dir, rank))
    except Exception as exc:
        log.exception("simulated engine could not start")
        ready.send(EngineFailed(rank, f"simulated engine could not start: {exc}", False))
        return
    engine = SimulatedEngine(sentence_ids, info.eos_token_ids[0], info.max_model_len)
    log.warning("SIMULATED engine (benchmark instrument, no model): one step every %.1f ms", interval * 1000)
    ready.send(EngineReady(rank, info))
    try:
        _serve(router, engine, interval, stopping)
    except Exception as exc:
        log.exception("simulated engine loop failed")
        for identity in engine.identities:
            router.send_multipart([identity, *codec.encode(EngineDead(f"{exc.__class__.__name__}: {exc}"))])
        time.sleep(0.1)  # let ZMQ hand the last messages to the kernel before we go
        os._exit(1)
    router.close()
    ctx.term()


def _serve(router: zmq.Socket, engine: SimulatedEngine, interval: float, stopping: list) -> None:
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    next_step = None  # monotonic time of the next step while anything runs
    while not stopping:
        if next_step is None:
            timeout_ms = 200  # idle: wake now and then only to notice a signal
        else:
            timeout_ms = max(0.0, (next_step - time.monotonic()) * 1000)
        if poller.poll(timeout_ms):
            _receive_all(router, engine)
        if engine.running and next_step is None:
            next_step = time.monotonic() + interval
        if next_step is not None and time.monotonic() >= next_step:
            for identity, outputs in engine.step().items():
                record = EngineOutputs(outputs, num_running=len(engine.running))
                router.send_multipart([identity, *codec.encode(record)], copy=False)
            # A fixed pace, without drift, unless we fell more than a step behind.
            next_step = max(next_step + interval, time.monotonic()) if engine.running else None


def _receive_all(router: zmq.Socket, engine: SimulatedEngine) -> None:
    while True:
        try:
            identity, *frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        engine.identities.add(identity)
        try:
            record = codec.decode(frames)
        except codec.MalformedMessage as exc:
            log.error("dropped a malformed message from %r: %s", identity, exc)
            continue
        if isinstance(record, EngineRequest):
            engine.add(identity, record)
        elif isinstance(record, AbortRequests):
            if record.indices is None:  # single choices: not yet (its choices never differ anyway)
                engine.abort(record.request_ids)
        elif isinstance(record, UtilityCall):
            router.send_multipart([identity, *codec.encode(_call_utility(engine, record))])


def _call_utility(engine: SimulatedEngine, call: UtilityCall) -> UtilityResult:
    if call.method == "ping":
        return UtilityResult(call.call_id, "pong")
    if call.method == "stats":
        return UtilityResult(call.call_id, engine.stats())
    if call.method == "reset_prefix_cache":
        return UtilityResult(call.call_id, True)
    if call.method == "abort_client":
        return UtilityResult(call.call_id, engine.abort_client(*call.args))
    return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
