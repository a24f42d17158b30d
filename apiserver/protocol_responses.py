"""The request body of POST /v1/responses (OpenAI's Responses API) as a pydantic model: what a stateless server
with one text model can honour.

Nothing is stored: a response cannot be fetched later or continued by its id (`previous_response_id`,
`conversation`), so a client sends the whole conversation in `input`, as the items of earlier responses (their
messages, reasoning and function calls, passed back as they came) and its own (messages, function call outputs).
Only function tools: OpenAI's hosted tools (web search, file search, computer use, ...) run on OpenAI's side.
Fields that ask for what is not done here are refused by name, as in apiserver/protocol.py.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from apiserver.protocol import (
    INT32_MAX, MAX_LABEL_LENGTH, JsonObject, ReasoningEffort, StrictNumber, ToolName, _MessagePart, _Strict,
    nulls_mean_default,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(_Strict):
    """A message's text: `input_text` in what a client writes, `output_text` in an assistant message passed back
    (its annotations and logprobs are the earlier response's, read no further)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list | None = None
    logprobs: list | None = None


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: StrictStr


_PART_TAGS = {"input_text": "TextPart", "output_text": "TextPart", "refusal": "RefusalPart"}


def _type_of(value, default: str | None = None) -> str | None:
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


def _part_kind(value) -> str | None:
    return _PART_TAGS.get(_type_of(value) or "")


ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("TextPart")], Annotated[RefusalPart, Tag("RefusalPart")]],
    Discriminator(_part_kind, custom_error_type="content_part_type", custom_error_message=(
        "a content part must be of type input_text, output_text or refusal (this server reads text only)")),
]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[ContentPart]]
    id: StrictStr | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's, as OpenAI gave it


class FunctionCallItem(_Strict):
    """A call an earlier response made, passed back before its output."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it
    id: StrictStr | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: Union[StrictStr, list[TextPart]]
    id: StrictStr | None = None
    status: ItemStatus | None = None


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: StrictStr


class ReasoningTextPart(_Strict):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    """An earlier response's reasoning, passed back: it goes to the chat template with the assistant turn after
    it, as a chat request's `reasoning_content`."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[SummaryPart] = []
    content: list[ReasoningTextPart] | None = None
    encrypted_content: None = None  # OpenAI's own, opaque to any other server
    status: ItemStatus | None = None


_ITEM_TAGS = {
    "message": "MessageItem", "function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}


def _item_kind(value) -> str | None:
    """An item's model by its `type`; a message may leave it out (OpenAI's "easy input message")."""
    return _ITEM_TAGS.get(_type_of(value, "message") or "")


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("MessageItem")], Annotated[FunctionCallItem, Tag("FunctionCallItem")],
          Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
          Annotated[ReasoningItem, Tag("ReasoningItem")]],
    Discriminator(_item_kind, custom_error_type="input_item_type", custom_error_message=(
        "an input item must be of type message, function_call, function_call_output or reasoning (nothing is "
        "stored here, so no item_reference; only function tools, so no other tools' calls)")),
]


class FunctionTool(_Strict):
    """Responses' function tools are flat: the chat API's `{"type", "function": {...}}` in one object. The
    fields are FunctionDefinition's, after `type`: checked first, a hosted tool's error names its type."""

    type: Literal["function"]
    name: ToolName
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class AllowedFunction(_MessagePart):
    """A function by its name (a whole definition, as a client may send, is read so)."""
    type: Literal["function"]
    name: StrictStr


class AllowedFunctions(_Strict):
    """The model may call only these of the request's tools (`mode` says whether it must call one). Only function
    tools: the others (mcp, image_generation...) are not served here."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1, max_length=128)


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    model_config = _Strict.model_config | {"populate_by_name": True}

    type: Literal["json_schema"]
    name: StrictStr = Field(max_length=64)
    schema_: JsonObject = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: Annotated[Union[FormatText, FormatJsonObject, FormatJsonSchema], Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; shorter or longer answers: nothing here does that


class ReasoningConfig(_Strict):
    """`effort` goes to the chat template as its `reasoning_effort` variable, as a chat request's field of that name
    (refused where the template reads none). No summaries are written: the reasoning itself comes in the item's
    `content`, so only `auto` (the model decides, and it writes none)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # the older name of `summary`


class ResponsesStreamOptions(_Strict):
    include_obfuscation: StrictBool | None = None  # OpenAI pads events against side channels; nothing to pad here


# What a stateless server with function tools only cannot do, and what to do instead.
_REFUSED = {
    "previous_response_id": "nothing is stored; send the whole conversation in `input`, with the output items of "
                            "earlier responses",
    "conversation": "nothing is stored; send the whole conversation in `input`, with the output items of earlier "
                    "responses",
    "prompt": "no prompt templates are stored here",
    "max_tool_calls": "only function tools, which the client runs: it decides how many calls to make",
}


class ResponsesRequest(_Strict):
    model: StrictStr
    input: Union[StrictStr, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=INT32_MAX)
    temperature: StrictNumber | None = Field(None, ge=0.0, le=100.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    # By `type`, so that an error names the fields of the kind of choice sent.
    tool_choice: Union[Literal["none", "auto", "required"],
                       Annotated[Union[FunctionChoice, AllowedFunctions], Field(discriminator="type")], None] = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # Labels that ask for nothing: `store` too, since nothing is stored whatever it says (the response says
    # `"store": false`); OpenAI's default is true, and clients send it.
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = Field(None, max_length=MAX_LABEL_LENGTH)
    safety_identifier: StrictStr | None = Field(None, max_length=MAX_LABEL_LENGTH)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    context_management: None = None  # OpenAI's compaction of a long conversation: there is none here
    truncation: Literal["disabled"] | None = None  # "auto" would drop input items to fit: a 400 instead
    # Extra output. Encrypted reasoning carries the reasoning of a stateless conversation to its next turn (Codex
    # asks for it): here the reasoning comes as text in the item's `content`, and passed back that is read, so the
    # ask is met with `encrypted_content` null. Logprobs go in the `output_text` part. Anything else (hosted
    # tools' outputs) is refused.
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # the likeliest tokens per token, with logprobs
    background: Literal[False] | None = None

    previous_response_id: StrictStr | None = None
    conversation: Union[StrictStr, dict, None] = None
    prompt: dict | None = None
    max_tool_calls: StrictInt | None = None

    responses_nulls = nulls_mean_default("stream")

    @property
    def wants_logprobs(self) -> bool:
        """Asked by name, or by asking for top logprobs (which come with them)."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    @field_validator(*_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value, info: ValidationInfo):
        if value is not None:
            raise PydanticCustomError("unsupported", "not supported by this server: {reason}",
                                      {"reason": _REFUSED[info.field_name or ""]})
        return value
