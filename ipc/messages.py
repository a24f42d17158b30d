"""The typed records that travel between API servers and engine cores.

Towards the engine: ADD (EngineRequest), ABORT (AbortRequests), UTILITY (UtilityCall).
Back from the engine: OUTPUTS (EngineOutputs, one per engine step and API server), UTILITY_RESULT,
ENGINE_DEAD. The engine works in token ids only; text lives in the API servers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Self

from ipc.sampling import SamplingParams
from ipc.typecheck import checked


class Record:
    """A message body: a dataclass whose fields orjson writes as a dict; from_dict rebuilds it."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(**d)


class CheckedRecord(Record):
    """A record towards an engine, which may come from another machine: every field is checked for its type
    (ipc/typecheck.py) before the engine reads it, so a malformed one is dropped, never raised in a step."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return checked(cls, d)


class Kind:
    """First frame of every message: one byte that says which record the second frame holds."""

    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    OUTPUTS = b"O"
    UTILITY_RESULT = b"R"
    ENGINE_DEAD = b"D"


class FinishReason:
    STOP = "stop"  # EOS or a stop token id (stop_reason says which id)
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request alone (RequestOutput.error says why); it carries on


@dataclass
class EngineRequest(CheckedRecord):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    # Where this prompt's first choice falls among the sequences of its API request (prompt i of a request with n
    # choices: i * n). The engine shares its slots between requests by it (enginecore.scheduler): the k-th sequence
    # of a request of 256 prompts with n=128 waits as if it had come k requests later, not ahead of all that come.
    ordinal: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        if isinstance(d, dict) and "sampling" in d:
            d["sampling"] = checked(SamplingParams, d["sampling"])
        return checked(cls, d)


@dataclass
class AbortRequests(CheckedRecord):
    request_ids: list[str]
    # None: every choice of each request. Else only these choice indices (a choice that a stop string ended
    # while the request's other choices go on); the request's other choices keep running.
    indices: list[int] | None = None



@dataclass
class UtilityCall(CheckedRecord):
    """A named method of the engine core called by an API server (`ping`, `stats`, `reset_prefix_cache`) or by the
    supervisor (`abort_client` with an API server's identity, e.g. "api-3": the engine aborts every request of
    that server and returns how many)."""

    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)



@dataclass
class UtilityResult(Record):
    call_id: int
    result: object = None
    error: str | None = None



@dataclass
class RequestOutput:
    """What one step produced for one sequence (choice `index` of request `request_id`)."""

    request_id: str
    new_token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # One entry per new token: [sampled token's logprob, [[token_id, logprob], ...top]]
    logprobs: list[Any] | None = None
    # Once per sequence, with its first output token (choice 0 only when n > 1): one entry per prompt token from
    # the second on, in the same shape as `logprobs`.
    prompt_logprobs: list[Any] | None = None
    error: str | None = None  # why, when finish_reason is FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def error_summary(error: str, limit: int = 300) -> str:
    """An error's first line, at most `limit` characters: what a client is told of a reason a library wrote (some
    of llguidance's run to tens of KB: its parser state and the whole grammar). The log gets the whole reason."""
    lines = error.strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


@dataclass
class EngineOutputs(Record):
    outputs: list[RequestOutput]
    # The engine's load after this step, so API servers can report and balance.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        d["outputs"] = [_request_output(o) for o in d["outputs"]]
        return cls(**d)


_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestOutput))
_new_output = object.__new__


def _request_output(fields: dict[str, Any]) -> RequestOutput:
    """A RequestOutput from its decoded JSON object, which the engine writes whole (every field): the object
    becomes the instance's attributes as it is, without __init__'s keyword processing. An API server decodes one
    per streamed token (256 in a step's message: 188 us through __init__, a fifth of that this way)."""
    if fields.keys() != _OUTPUT_FIELDS:  # not as an engine writes it: __init__ says what is wrong or fills defaults
        return RequestOutput(**fields)
    output = _new_output(RequestOutput)
    output.__dict__ = fields
    return output


@dataclass
class EngineDead(Record):
    reason: str



RECORD_OF_KIND: dict[bytes, type[Record]] = {
    Kind.ADD: EngineRequest,
    Kind.ABORT: AbortRequests,
    Kind.UTILITY: UtilityCall,
    Kind.OUTPUTS: EngineOutputs,
    Kind.UTILITY_RESULT: UtilityResult,
    Kind.ENGINE_DEAD: EngineDead,
}
KIND_OF_RECORD = {record: kind for kind, record in RECORD_OF_KIND.items()}
