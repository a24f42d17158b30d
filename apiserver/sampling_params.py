"""From a validated request to the engine's SamplingParams: request fields over the model's
generation_config.json defaults, over the engine's own defaults; and the context-length checks."""
from __future__ import annotations

from apiserver.errors import InvalidRequest
from apiserver.stop_strings import NO_STOP_STRINGS, StopStrings
from ipc.config import ServeConfig
from ipc.sampling import SamplingParams

# Request field -> (generation_config key, value when neither the request nor the model says).
_DEFAULTED = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 0),
    "min_p": ("min_p", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
}


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (None: all of it; -1: the model's length).
    0 is refused: Python's [-0:] would keep everything, and a prompt of nothing cannot run."""
    if keep is None:
        return prompt
    if keep == 0:
        raise InvalidRequest("`truncate_prompt_tokens` must be at least 1 (or -1: the model's maximum length).",
                             param="truncate_prompt_tokens")
    if keep > max_model_len:
        raise InvalidRequest(f"`truncate_prompt_tokens` ({keep}) is larger than this model's maximum context length "
                             f"({max_model_len}).", param="truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return prompt[-keep:] if len(prompt) > keep else prompt


def max_tokens_for(prompt_len: int, requested: int | None, max_model_len: int, what: str = "messages") -> int:
    """The completion budget: `requested`, or all the room the context has left. 400 when it does not fit."""
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input {what}.",
            param=what,
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


WHOLE_LOGPROBS_ADVICE = "Stream it, or ask for fewer tokens (max_tokens), choices (n) or top logprobs."


def check_whole_logprobs(choices: int, max_tokens: int, top_n: int, prompt_tokens: int, limit: int,
                         param: str, advice: str = WHOLE_LOGPROBS_ADVICE) -> None:
    """400 when a whole response (not streamed, or a Responses API one) could hold more than `limit` logprob
    entries: it keeps every choice's until it is written (a token's entry and its `top_n` alternatives, about 400
    bytes of the API server's memory each, and its JSON), so n=128 with 20 top logprobs over a long context was
    gigabytes (one request, one API server out of memory). `choices`: n, times the prompts of a completion batch;
    `prompt_tokens`: the echoed prompts' tokens. A chat or completion stream writes its entries as they come and
    keeps none. `advice`: the way out, in the words of the request's API."""
    worst = (choices * max_tokens + prompt_tokens) * (1 + top_n)
    if limit and worst > limit:
        raise InvalidRequest(
            f"This request could return {worst:,} logprob entries (tokens x (1 + top logprobs), over every choice), "
            f"more than the {limit:,} a whole response may hold (--max-logprob-entries). {advice}",
            param=param,
        )


def check_echo(choices: int, prompt_tokens: int, limit: int) -> None:
    """400 when a completion's `echo` would send back more than `limit` prompt tokens: every choice repeats its
    prompt's text, so 256 prompts of 5,000 tokens (an 8 MB body) with n=128 made a 1 GB response, which held the
    API server's event loop 3.4 s and grew it 1 GB. `choices`: n; `prompt_tokens`: all the prompts' tokens."""
    worst = choices * prompt_tokens
    if limit and worst > limit:
        raise InvalidRequest(
            f"This request would echo {worst:,} prompt tokens (n x the prompts' tokens), more than the {limit:,} a "
            f"response may repeat (--max-echo-tokens). Ask for fewer choices (n) or prompts, or no echo.",
            param="echo",
        )


LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token in effect, 100 makes it the only choice


def logit_bias(bias: dict | None, vocab_size: int, limit: int) -> tuple[list[int], list[float]]:
    """OpenAI's `logit_bias` ({token id: bias}; the ids are strings in JSON, ints from gRPC) as the engine's two
    lists, each id once. A 400 for a key that is not a token id of the vocabulary, a bias outside -100 to 100, or
    more than `limit` entries (--max-logit-bias-entries; 0: none)."""
    if not bias:
        return [], []
    if limit and len(bias) > limit:
        raise InvalidRequest(f"`logit_bias` gives {len(bias):,} tokens a bias; at most {limit:,} are served "
                             f"(--max-logit-bias-entries).", param="logit_bias")
    low, high = LOGIT_BIAS_RANGE
    biases: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _token_id(key)
        if token_id is None or not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"`logit_bias` holds the key {str(key)[:40]!r}, which is not a token id of the "
                                 f"vocabulary (0 to {vocab_size - 1}).", param="logit_bias")
        if not low <= value <= high:  # NaN too
            raise InvalidRequest(f"`logit_bias` gives token {token_id} the bias {value:g}; a bias goes from {low:g} "
                                 f"to {high:g}.", param="logit_bias")
        biases[token_id] = float(value)
    return list(biases), list(biases.values())


def _token_id(key: str | int) -> int | None:
    """A key's token id: an int as it is, a string of ASCII digits (10 at most: past 32 bits anyway) as its number;
    None for anything else ("-1", " 5", "1e3", "٥")."""
    if isinstance(key, int):
        return key
    return int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else None


def sampling_params(request, defaults: dict, max_tokens: int, logprobs: int | None, vocab_size: int,
                    prompt_logprobs: int | None = None, grammar: str | None = None,
                    max_logit_bias_entries: int = 0) -> SamplingParams:
    values = {}
    for name, (key, fallback) in _DEFAULTED.items():
        value = getattr(request, name)
        values[name] = value if value is not None else defaults.get(key, fallback)
    if values["top_k"] < 0:  # vLLM's -1 and our 0 both mean off
        values["top_k"] = 0
    stop_token_ids = request.stop_token_ids or []
    for token_id in stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"`stop_token_ids` holds {token_id}, outside the vocabulary.", param="stop_token_ids")
    if request.min_tokens > max_tokens:
        raise InvalidRequest(
            f"`min_tokens` ({request.min_tokens}) is larger than `max_tokens` ({max_tokens}).", param="min_tokens"
        )
    bias_ids, bias_values = logit_bias(request.logit_bias, vocab_size, max_logit_bias_entries)
    return SamplingParams(
        max_tokens=max_tokens,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=request.seed,
        stop_token_ids=sorted(set(stop_token_ids)),  # once each: at most the vocabulary, whatever was sent
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        n=request.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
        **values,
    )


def stop_strings(stop, config: ServeConfig) -> StopStrings:
    """The request's stop strings, each once; a 400 past --max-stop-strings strings or --max-stop-string-chars
    characters in all: each is looked for in every token's text that could end it, in
    the event loop (10,000 of them on 16 choices held it past the heartbeat timeout; 64 of 20,000 characters on 16
    choices of 8,000 tokens took 23 s of its CPU against 1.6 s without)."""
    if stop is None:
        return NO_STOP_STRINGS
    strings = list(dict.fromkeys([stop] if isinstance(stop, str) else stop))
    limit, char_limit = config.max_stop_strings, config.max_stop_string_chars
    if limit and len(strings) > limit:
        raise InvalidRequest(f"`stop` holds {len(strings):,} strings; at most {limit:,} are served (--max-stop-strings).",
                             param="stop")
    chars = sum(map(len, strings))
    if char_limit and chars > char_limit:
        raise InvalidRequest(f"`stop` holds {chars:,} characters in all; at most {char_limit:,} are served "
                             f"(--max-stop-string-chars).", param="stop")
    return StopStrings(strings)
