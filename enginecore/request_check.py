"""What an engine checks of an ADD before it takes the request: the types of the fields its own bookkeeping reads.

The API servers validate what users send; this guards the engine against an API server that sends what the engine
cannot take (a bug, or a hostile process on the socket): such a request fails alone, with an error output, before
it touches any state, instead of raising later inside a step, where a failure is fatal. The sampler's own fields
(temperature, top_p, top_k, min_p, penalties, logprobs) are the sampler's: a row it cannot sample fails its
request alone there (enginecore.sampler.Sampler.sample_each).
"""
from __future__ import annotations

from ipc.messages import EngineRequest
from ipc.typecheck import matches


class BadRequest(ValueError):
    """The request cannot be served as sent (one line, sent back as the request's error)."""


def check_request(request: EngineRequest) -> None:
    """Raise BadRequest naming the first field of `request` the engine cannot take."""
    if not isinstance(request.request_id, str):
        raise BadRequest("request_id must be a string")
    _ints(request.prompt_token_ids, "prompt_token_ids")
    _int(request.priority, "priority")
    _int(request.ordinal, "ordinal")
    if request.ordinal < 0:  # it would put the request ahead of every other in the fair share
        raise BadRequest("ordinal must not be negative")
    p = request.sampling
    for name in ("n", "max_tokens", "min_tokens"):
        _int(getattr(p, name), name)
    for name in ("seed", "prompt_logprobs"):
        if getattr(p, name) is not None:
            _int(getattr(p, name), name)
    _ints(p.stop_token_ids, "stop_token_ids")
    _ints(p.logit_bias_ids, "logit_bias_ids")
    if not matches(p.logit_bias_values, list[float]) or len(p.logit_bias_values) != len(p.logit_bias_ids):
        raise BadRequest("logit_bias_values must be a list of numbers, one per logit_bias_ids")
    if not isinstance(p.ignore_eos, bool):
        raise BadRequest("ignore_eos must be a boolean")
    if p.grammar is not None and not isinstance(p.grammar, str):
        raise BadRequest("grammar must be a string (llguidance's JSON)")


def _int(value, name: str) -> None:
    if not matches(value, int):
        raise BadRequest(f"{name} must be an integer, not {type(value).__name__}")


def _ints(values, name: str) -> None:
    # The same test as the decoding of records from the network (in C over the list: a prompt may be long).
    if not matches(values, list[int]):
        raise BadRequest(f"{name} must be a list of integers")
