"""Request bodies of the OpenAI API as pydantic models: what a request may hold, validated in one pass.

Only requests are models: responses are plain dicts (and stream chunks plain bytes) built straight from engine
outputs, because constructing pydantic objects per response or per token costs more than the rest of the path.

Unknown fields are refused with a 400 that names them (extra="forbid"). OpenAI fields that a text model here
cannot honour (audio, prediction, ...) are declared with type None: clients that send them as null, as some
SDKs do, pass; any real value is refused with a message that names the field. Inside a chat message, though,
keys this server does not read are dropped (_MessagePart), as vLLM drops them.
"""
from __future__ import annotations

from typing import Annotated, Literal, TypeVar, Union

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, ValidationInfo, field_validator,
)
from pydantic_core import PydanticCustomError

JsonObject = dict  # any JSON object (a schema, a function's parameters)
T = TypeVar("T")

# OpenAI fields accepted only as null (or a value that asks for nothing: see _SamplingFields): a value asks for
# something this server does not do.
UNSUPPORTED_FIELDS = (
    "functions", "function_call", "audio", "modalities", "prediction",
    "web_search_options", "suffix", "best_of", "service_tier", "refusal", "verbosity",
)


class Undone:
    """Marks a vLLM field this server does not do, declared to accept only the values that ask for nothing: any
    other value is refused as "Unsupported value for `field`: <reason>" (apiserver.validation reads the mark from
    the field of the request's own model, so a completion's `echo` keeps its own errors)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


_NOT_DONE = Undone("not supported by this server")
_BEAM = Undone("beam search is not done by this server")
_STRUCTURED = Undone("vLLM's old name for structured outputs: send `structured_outputs` (`json`, `regex`, `choice`, "
                     "`grammar`)")


# An unsupported field's value that asks for nothing: an empty object or list.
NoValue = Annotated[T, Field(max_length=0)]

# A JSON number (an int is fine too), never a string or a bool.
StrictNumber = Annotated[float, Field(strict=True)]

# Every integer that reaches the engine must fit what the engine stores it in (the IPC encoder refuses wider
# ones): 64 bits for seeds and priorities (vLLM's bounds), 32 bits for counts.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # and below the vocabulary's size, checked later
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
MAX_LABEL_LENGTH = 1024  # `prompt_cache_key`, `safety_identifier`: kept no further than the request's parse
MAX_REQUEST_ID_LENGTH = 256  # the body's `request_id`, and the X-Request-Id header (apiserver.serving)


class _Strict(BaseModel):
    # NaN and Infinity are not JSON, but Python's json.dumps writes them and pydantic reads them: refused as what
    # they are, not as a number past a field's bound ("should be less than or equal to 100" for a NaN).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _default_if_null(cls, value, info: ValidationInfo):
    return cls.model_fields[info.field_name].default if value is None else value


def nulls_mean_default(*fields: str):
    """A validator reading null in `fields` as the field's default. OpenAI's schema gives these as "X or null,
    defaults to ...", and SDKs that write every field send null for what the user left unset (vLLM reads it so
    too); the other fields' types say None themselves. Each model names its own, under a name of its own (a
    subclass's validator of the same name would replace its base's)."""
    return field_validator(*fields, mode="before")(classmethod(_default_if_null))


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    # OpenAI's random padding of stream events against length side channels (on by default there): none is added
    # here, whatever it says; a client that turns it off, as the openai package lets one do, asks for nothing.
    include_obfuscation: StrictBool | None = None

    stream_options_nulls = nulls_mean_default("include_usage", "continuous_usage_stats")


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr = Field("response", max_length=64)
    description: StrictStr | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint, and how JSON may be written."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: Union[JsonObject, StrictStr, None] = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False


class _MessagePart(BaseModel):
    """A chat message and what it holds: keys this server does not read are dropped, as vLLM drops them (it types
    messages with the openai package's TypedDicts), not refused. Client libraries pass a reply's message back in
    the next request as they hold it, with keys of their own: LiteLLM's `provider_specific_fields` on every
    message, the openai package's `parsed` after `chat.completions.parse()`; refused, every second turn of such a
    conversation was a 400. Fields that carry what this server cannot honour stay declared, and refused."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# A function tool's name, as OpenAI allows it (chat completions' and the Responses API's tools).
ToolName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(_Strict):
    name: ToolName
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _FunctionRef(_MessagePart):
    name: StrictStr


class AllowedFunction(_MessagePart):
    """One of `allowed_tools`: a function by its name (a whole definition, as a client may send, is read so)."""
    type: Literal["function"]
    function: _FunctionRef


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1, max_length=128)


class AllowedToolsChoice(_Strict):
    """The model may call only these of the request's tools (`mode` says whether it must call one)."""
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ToolCallFunction(_MessagePart):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(_MessagePart):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_MessagePart):
    type: Literal["text"]
    text: StrictStr

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value):
        """An image, audio or file part says why it is refused (the Responses API's parts say it too)."""
        if value != "text":
            raise PydanticCustomError("text_only", "a content part must be of type text (this server reads "
                                      "text only)")
        return value


class ChatMessage(_MessagePart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool's answer: to which call
    reasoning_content: StrictStr | None = None  # an assistant's reasoning (as the reply gave it)
    reasoning: StrictStr | None = None  # the same under vLLM's newer name (read where reasoning_content is not given)
    # What OpenAI clients send back when they pass a reply's message on as it is: accepted as null only, since a
    # value would be a turn this server cannot render (a refusal, an audio answer, a legacy function call).
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list | None = None  # a reply's URL citations ([] from OpenAI's own replies): nothing to render
    # A tool message must name its call (`tool_call_id`): checked by apiserver.chat_messages, which says why there.


class _SamplingFields(_Strict):
    """Fields both generation endpoints share: OpenAI's, then the engine's extras (vLLM's names)."""

    # Left out (or null): the served model, as vLLM and /invocations take it; OpenAI's API requires it.
    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    seed: Int64 | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: StrictNumber | None = Field(None, ge=0.0, le=100.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    user: StrictStr | None = None
    # OpenAI's successors of `user`, labels that ask for nothing here: a prefix-cache routing hint (the engine
    # caches prefixes by their tokens anyway) and an end user's id for abuse monitoring. The openai package takes
    # both as arguments and applications pass them on; refusing them broke such clients for nothing.
    prompt_cache_key: StrictStr | None = Field(None, max_length=MAX_LABEL_LENGTH)
    safety_identifier: StrictStr | None = Field(None, max_length=MAX_LABEL_LENGTH)
    # How long OpenAI keeps a prompt's cache: a hint, as prompt_cache_key is (the engine's prefix cache is its own).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Nothing is stored here whatever it says (the Responses API's reply says `"store": false`); LangChain's
    # `ChatOpenAI(store=True)` and others send it.
    store: StrictBool | None = None

    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: StrictNumber | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictNumber | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Int64 = 0
    request_id: StrictStr | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_LENGTH)
    data_parallel_rank: StrictInt | None = Field(None, ge=0, le=INT32_MAX)  # smg's pin (X-data-parallel-rank's)

    # Fields vllm-router adds to every request it forwards (SGLang's names), accepted at the values it sends,
    # which ask for nothing this server does not do anyway; any other value is refused with the field's name.
    no_stop_trim: Literal[False] | None = None
    separate_reasoning: Literal[True] | None = None
    stream_reasoning: Literal[True] | None = None
    return_hidden_states: Literal[False] | None = None
    include_reasoning: Literal[True] | None = None

    # vLLM's own extensions that this server does not do, accepted at the values that ask for nothing (their
    # defaults, null, empty): clients built on vLLM's request classes, and proxies that forward every field, send
    # them so. Any other value is refused with the field's name and its Undone reason.
    use_beam_search: Annotated[Literal[False] | None, _BEAM] = None
    length_penalty: Annotated[Literal[1] | None, _BEAM] = None
    spaces_between_special_tokens: Annotated[Literal[True] | None, Undone(
        "special tokens are always decoded with the spaces between them")] = None
    # vLLM's: keep only the prompt's last k tokens (-1: the model's length); apiserver.sampling_params.truncated.
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    prompt_logprobs: Annotated[None, Undone(
        "send the prompt to /v1/completions with `echo` and `logprobs` for its logprobs")] = None
    allowed_token_ids: Annotated[None, Undone("use `logit_bias` or `structured_outputs`")] = None
    bad_words: Annotated[NoValue[list] | None, Undone("use `logit_bias`")] = None
    return_tokens_as_token_ids: Annotated[Literal[False] | None, _NOT_DONE] = None
    return_token_ids: Annotated[Literal[False] | None, Undone(
        "not supported by this server: /tokenize gives a text's token ids")] = None
    cache_salt: Annotated[None, Undone("the prefix cache is shared by all requests of this server")] = None
    logits_processors: Annotated[None, _NOT_DONE] = None
    kv_transfer_params: Annotated[NoValue[dict] | None, _NOT_DONE] = None
    vllm_xargs: Annotated[NoValue[dict] | None, _NOT_DONE] = None
    # vLLM's names before structured_outputs (gone from vLLM since v0.12): refused with a pointer to it.
    guided_json: Annotated[None, _STRUCTURED] = None
    guided_regex: Annotated[None, _STRUCTURED] = None
    guided_choice: Annotated[None, _STRUCTURED] = None
    guided_grammar: Annotated[None, _STRUCTURED] = None
    guided_decoding_backend: Annotated[None, _STRUCTURED] = None
    guided_whitespace_pattern: Annotated[None, _STRUCTURED] = None

    sampling_nulls = nulls_mean_default("n", "stream", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                                        "skip_special_tokens", "priority")

    # {token id (a string, as JSON keys are): bias}: ids and bounds checked with the vocabulary
    # (apiserver.sampling_params.logit_bias); {} asks for nothing (legacy LangChain sends it by default).
    logit_bias: dict[StrictStr, StrictNumber] | None = None
    # Unsupported, but also accepted at values that ask for nothing, which some clients send by default;
    # `metadata` only labels a request for OpenAI's stored completions, as `user` does.
    functions: NoValue[list] | None = None
    function_call: None = None
    audio: None = None
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None  # ["text"]: what is made anyway
    verbosity: Literal["medium"] | None = None  # OpenAI's default; "low" and "high" ask for what is not done here
    prediction: None = None
    web_search_options: None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    service_tier: Literal["auto", "default"] | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options_without_stream", "allowed only when `stream` is true")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict | None = None
    # A chat template variable, as vLLM passes it (gpt-oss's template reads it): refused where the template reads
    # no `reasoning_effort`, since nothing else here could honour it (apiserver.serving_chat.template_kwargs).
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    # By `type`, so that an error names the fields of the kind of choice sent.
    tool_choice: Union[Literal["none", "auto", "required"],
                       Annotated[Union[NamedToolChoice, AllowedToolsChoice], Field(discriminator="type")], None] = None
    parallel_tool_calls: StrictBool | None = None

    # vLLM's chat extensions not done here (see _SamplingFields): at their defaults only.
    echo: Annotated[Literal[False] | None, Undone(
        "a chat's echo is not supported by this server (/v1/completions' is)")] = None
    add_special_tokens: Annotated[Literal[False] | None, Undone("only this endpoint's default is supported")] = None
    documents: Annotated[NoValue[list] | None, _NOT_DONE] = None
    chat_template: Annotated[None, Undone("a request's own chat template is not supported by this server")] = None
    mm_processor_kwargs: Annotated[NoValue[dict] | None, Undone("this server reads text only")] = None

    chat_nulls = nulls_mean_default("logprobs", "add_generation_prompt", "continue_final_message")


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_kind(value) -> str:
    """Which of the prompt's forms `value` is, from its first item: tried as every form in turn (a plain union),
    a list of 4 million token ids failed as strings item by item first, and the errors held the event loop 1.3 s
    of the 1.5 s its parse took (0.4 s with this)."""
    if not isinstance(value, list) or not value:
        return "str" if not isinstance(value, list) else "list[str]"
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return "list[int]"
    return "list[list[int]]" if isinstance(first, list) else "list[str]"


# The tags are the forms' type names, which apiserver.validation leaves out of an error's field path.
Prompt = Annotated[
    Union[Annotated[StrictStr, Tag("str")], Annotated[list[StrictStr], Tag("list[str]")],
          Annotated[TokenIds, Tag("list[int]")], Annotated[list[TokenIds], Tag("list[list[int]]")]],
    Discriminator(_prompt_kind),
]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=0, le=INT32_MAX)  # 0 only with echo: the prompt (and its logprobs) alone
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: None = None
    best_of: Literal[1] | None = None  # one candidate per choice: what is done anyway
    # vLLM's, at its default for completions (see _SamplingFields)
    add_special_tokens: Annotated[Literal[True] | None, Undone("only this endpoint's default is supported")] = None
    prompt_embeds: Annotated[None, Undone("this server reads text and token ids only")] = None

    completion_nulls = nulls_mean_default("echo")


class TokenizeCompletionRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False  # vLLM's: each id's token as the vocabulary spells it

    tokenize_nulls = nulls_mean_default("add_special_tokens", "return_token_strs")


class TokenizeChatRequest(_Strict):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)  # rendered by the chat template, as for a chat request
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False

    tokenize_chat_nulls = nulls_mean_default("add_generation_prompt", "continue_final_message", "add_special_tokens",
                                             "return_token_strs")


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[TokenId]
