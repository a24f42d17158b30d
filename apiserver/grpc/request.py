"""A GenerateRequest (vllm_engine.proto) to what the engine client takes, or INVALID_ARGUMENT with a message
that names the field.

The limits are the HTTP API's (apiserver/protocol.py, apiserver/sampling_params.py), so a request the HTTP
server refuses is refused here too. proto3 scalars have no "unset": 0 means unset for `top_p`, `top_k`,
`repetition_penalty` and `n` (as vLLM's own servicer reads them), so `n: 0` is one sample. A constraint
(`json_schema`, `json_object`, `regex`, `choice`, `grammar`) becomes the engine's grammar, as the HTTP API's
structured outputs do. Fields about text
(`stop`, `skip_special_tokens`, `include_stop_str_in_output`, ...) are accepted and left to the client: this
server holds no tokenizer, and the gateway that sends them matches stop strings in the text it decodes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from google.protobuf.unknown_fields import UnknownFieldSet

from apiserver.grammar_checker import GrammarChecker
from apiserver.grpc.status import invalid_argument
from apiserver.priority_header import BadPriority, header_priority
from apiserver.errors import InvalidRequest
from apiserver.sampling_params import check_whole_logprobs, max_tokens_for, sampling_params
from apiserver.structured_outputs import checked
from ipc import grammar as grammars
from ipc.config import ServeConfig
from ipc.model_info import ModelInfo
from ipc.sampling import SamplingParams

MAX_N = 128  # the HTTP API's limit on `n`
MAX_LOGPROBS = 20  # the engine's top-k limit (enginecore/sampler.py), as the HTTP API states it
MAX_REQUEST_ID = 256
# field: (lowest, highest, whether the lowest is allowed), for the floats the HTTP API bounds the same way
_FLOAT_RANGES = {
    "temperature": (0.0, 100.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
    "repetition_penalty": (0.0, 10.0, False),
}
# The proto's constraints by the names ipc/grammar.py gives them (structural_tag has none: refused).
_CONSTRAINT_KINDS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                     "grammar": "grammar"}


@dataclass
class GenerateInput:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: int
    stream: bool
    rank: int | None  # the data-parallel rank asked for: the engine client pins it (UnknownRank if not served)
    # The constraint, (its field, its value), whose grammar `constrain` puts in `sampling`.
    constraint: tuple[str, Any] | None = None


def parse_generate(request, metadata: dict, model: ModelInfo, config: ServeConfig) -> GenerateInput:
    """`config`: the limits (--max-logprob-entries: the most a call that is not streamed may hold;
    --max-logit-bias-entries). A constraint is only read here: `constrain` builds its grammar."""
    _refuse_unknown_fields(request)
    kept = _kept_ids(request, model)
    # refuses a prompt past the context
    sampling = _sampling(request.sampling_params, model, len(kept), config.max_logit_bias_entries)
    prompt = _in_vocabulary(list(kept), model)
    if not request.stream and (sampling.logprobs is not None or sampling.prompt_logprobs is not None):
        top = max(sampling.logprobs or 0, sampling.prompt_logprobs or 0)
        try:
            check_whole_logprobs(sampling.n if sampling.logprobs is not None else 0, sampling.max_tokens, top,
                                 len(prompt) if sampling.prompt_logprobs is not None else 0, config.max_logprob_entries,
                                 "logprobs")
        except InvalidRequest as exc:
            raise invalid_argument(exc.message) from None
    return GenerateInput(
        request_id=_request_id(request.request_id or metadata.get("x-request-id") or os.urandom(16).hex()),
        prompt=prompt,
        sampling=sampling,
        priority=_priority(metadata),
        stream=request.stream,
        rank=_rank(request, metadata),
        constraint=_constraint(request.sampling_params),
    )


async def constrain(call: GenerateInput, checker: GrammarChecker, max_choices: int | None) -> None:
    """The call's constraint as the engine's grammar (ipc/grammar.py), built and checked by the server's grammar
    checker to refuse a bad one with its reason; `max_choices`: the most strings a `choice` may list
    (--max-structured-output-choices). It applies from the first generated token: this engine runs no reasoning
    parser with --grpc, so `grammar_from_first_token` asks for what it does anyway (GetServerInfo says
    `first_token`)."""
    if call.constraint is None:
        return
    name, value = call.constraint
    param = f"sampling_params.{name}"
    try:
        grammar = await checker.build(_CONSTRAINT_KINDS[name], value, max_choices=max_choices)
        call.sampling.grammar = await checked(grammar, param, checker)
    except grammars.GrammarError as exc:
        raise invalid_argument(f"invalid `{param}`: {exc}") from None
    except InvalidRequest as exc:
        raise invalid_argument(exc.message) from None


def _refuse_unknown_fields(request) -> None:
    """A field this build of the proto does not know (a newer constraint type, say) would otherwise be dropped
    without a word, and the request served as if it had not asked."""
    for message, where in ((request, "GenerateRequest"), (request.sampling_params, "sampling_params"),
                           (request.tokenized, "tokenized")):
        unknown = UnknownFieldSet(message)
        if len(unknown):
            numbers = ", ".join(str(f.field_number) for f in unknown)
            raise invalid_argument(f"{where} holds field number(s) {numbers}, unknown to vllm_engine.proto as this "
                                   f"server has it (smg-grpc-proto): refused rather than ignored")


def _kept_ids(request, model: ModelInfo):
    """The prompt's token ids that `truncate_prompt_tokens` keeps, not yet checked against the vocabulary. Without
    truncation, the message's own container: a prompt longer than the context (an 8 MB message holds 4 million
    ids) is refused by its length alone; made a list first, it took 0.3 s of the event loop per call."""
    kind = request.WhichOneof("input")
    if kind == "text":
        raise invalid_argument("`text` input needs a tokenizer, which this server does not load: send token ids "
                               "in `tokenized.input_ids`")
    if kind is None:
        raise invalid_argument("the request has no input: send token ids in `tokenized.input_ids`")
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs) or request.HasField("media_refs"):
        raise invalid_argument("this model takes text only: multimodal inputs (`mm_inputs`, `extra_mm_inputs`, "
                               "`media_refs`) are refused")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise invalid_argument("KV transfer between prefill and decode workers is not supported by this server")
    ids = request.tokenized.input_ids
    if not len(ids):
        raise invalid_argument("`tokenized.input_ids` is empty: a prompt needs at least one token")
    params = request.sampling_params
    if params.HasField("truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = model.max_model_len - 1
        if keep < 1:
            raise invalid_argument("`truncate_prompt_tokens` must be at least 1 (or -1: the model's limit)")
        return ids[-keep:]  # vLLM's rule: the prompt's last tokens are kept (a slice is a list of those alone)
    return ids


def _in_vocabulary(prompt: list[int], model: ModelInfo) -> list[int]:
    vocab = model.vocab_size
    if max(prompt) >= vocab:
        bad = next(t for t in prompt if t >= vocab)
        raise invalid_argument(f"`tokenized.input_ids` holds {bad}, outside the vocabulary (0 to {vocab - 1})")
    return prompt


def _sampling(params, model: ModelInfo, prompt_len: int, max_logit_bias_entries: int) -> SamplingParams:
    for name, (low, high, low_allowed) in _FLOAT_RANGES.items():
        value = getattr(params, name)
        if name != "temperature" and value == 0.0 and not low_allowed:
            continue  # proto3's unset
        in_range = (low <= value if low_allowed else low < value) and value <= high
        if not in_range or math.isnan(value):
            bound = "[" if low_allowed else "("
            raise invalid_argument(f"`{name}` is {value:g}, outside {bound}{low:g}, {high:g}]")
    n = params.n or 1
    if n > MAX_N:
        raise invalid_argument(f"`n` is {n}: at most {MAX_N} samples per request")
    logprobs = _top_k(params, "logprobs")
    prompt_logprobs = _top_k(params, "prompt_logprobs")
    requested = params.max_tokens if params.HasField("max_tokens") else None
    if requested == 0 and prompt_logprobs is None:
        raise invalid_argument("`max_tokens` 0 generates nothing: it is allowed only with `prompt_logprobs`")
    max_tokens = max_tokens_for(prompt_len, requested, model.max_model_len, what="prompt")
    fields = SimpleNamespace(
        temperature=params.temperature if params.HasField("temperature") else None,
        top_p=params.top_p or None,
        top_k=params.top_k or None,
        min_p=params.min_p or None,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed if params.HasField("seed") else None,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        n=n,
        logit_bias=dict(params.logit_bias),
    )
    return sampling_params(fields, model.generation_defaults, max_tokens, logprobs, model.vocab_size, prompt_logprobs,
                           max_logit_bias_entries=max_logit_bias_entries)


def _constraint(params) -> tuple[str, Any] | None:
    """The call's constraint, (its field, its value), or None."""
    constraint = params.WhichOneof("constraint")
    if constraint is None or (constraint == "json_object" and not params.json_object):
        return None
    if constraint not in _CONSTRAINT_KINDS:
        raise invalid_argument(f"structured outputs by `{constraint}` are not supported by this server: use "
                               f"json_schema, json_object, regex, choice or grammar")
    value = getattr(params, constraint)
    return constraint, list(value.choices) if constraint == "choice" else value


def _top_k(params, name: str) -> int | None:
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if value == -1:
        raise invalid_argument(f"`{name}` -1 (every token of the vocabulary) is not supported: ask for at most "
                               f"{MAX_LOGPROBS}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid_argument(f"`{name}` is {value}: between 0 and {MAX_LOGPROBS}")
    return value


def _request_id(value: str) -> str:
    if len(value) > MAX_REQUEST_ID:
        raise invalid_argument(f"`request_id` is {len(value)} characters long: at most {MAX_REQUEST_ID}")
    return value


def _priority(metadata: dict) -> int:
    """`x-priority` (or vLLM's `x-vllm-priority`) metadata, read as the HTTP API reads the same headers."""
    try:
        priority = header_priority(metadata.get)
    except BadPriority as exc:
        raise invalid_argument(str(exc).replace("header", "metadata")) from None
    return 0 if priority is None else priority


def _rank(request, metadata: dict) -> int | None:
    if request.HasField("data_parallel_rank"):
        return request.data_parallel_rank
    if "x-data-parallel-rank" not in metadata:
        return None
    try:
        return int(metadata["x-data-parallel-rank"])
    except ValueError:
        raise invalid_argument("`x-data-parallel-rank` metadata must be an integer") from None
