"""Request bodies of the OpenAI API as pydantic models: what a request may hold, validated in one pass.

Only requests are models: responses are plain dicts (and stream chunks plain bytes) built straight from engine
outputs, because constructing pydantic objects per response or per token costs more than the rest of the path.

Unknown fields are refused with a 400 that names them (extra="forbid"). OpenAI fields that a text model here
cannot honour (logit_bias, audio, ...) are declared with type None: clients that send them as null, as some
SDKs do, pass; any real value is refused with a message that names the field.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

JsonObject = dict  # any JSON object (a schema, a function's parameters)

# OpenAI fields accepted only as null: a value asks for something this server does not do.
UNSUPPORTED_FIELDS = (
    "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
    "web_search_options", "suffix", "best_of", "metadata", "service_tier", "refusal", "annotations",
)


# A JSON number (an int is fine too), never a string or a bool.
StrictNumber = Annotated[float, Field(strict=True)]

# Every integer that reaches the engine must fit what the engine stores it in (the IPC encoder refuses wider
# ones): 64 bits for seeds and priorities (vLLM's bounds), 32 bits for counts.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # and below the vocabulary's size, checked later


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


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


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
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


class ToolCallFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool's answer: to which call
    reasoning_content: StrictStr | None = None  # an assistant's reasoning (as the reply gave it)
    # What OpenAI clients send back when they pass a reply's message on as it is: accepted as null only.
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_answer_names_its_call(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("tool_call_id_missing", "a tool message needs `tool_call_id`")
        return self


class _SamplingFields(_Strict):
    """Fields both generation endpoints share: OpenAI's, then the engine's extras (vLLM's names)."""

    model: StrictStr
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    store: Literal[False] | None = None

    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: StrictNumber | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictNumber | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Int64 = 0
    request_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    data_parallel_rank: StrictInt | None = Field(None, ge=0, le=INT32_MAX)  # smg's pin (X-data-parallel-rank's)

    # Fields vllm-router adds to every request it forwards (SGLang's names), accepted at the values it sends,
    # which ask for nothing this server does not do anyway; any other value is refused with the field's name.
    no_stop_trim: Literal[False] | None = None
    separate_reasoning: Literal[True] | None = None
    stream_reasoning: Literal[True] | None = None
    return_hidden_states: Literal[False] | None = None
    include_reasoning: Literal[True] | None = None

    logit_bias: None = None
    functions: None = None
    function_call: None = None
    audio: None = None
    modalities: None = None
    prediction: None = None
    reasoning_effort: None = None
    web_search_options: None = None
    metadata: None = None
    service_tier: None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    max_tokens: StrictInt | None = Field(16, ge=0, le=INT32_MAX)  # 0 only with echo: the prompt (and its logprobs) alone
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: None = None
    best_of: None = None


class TokenizeCompletionRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(_Strict):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: StrictBool = False


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[TokenId]
