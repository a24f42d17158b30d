"""A Responses API request as the chat completion request it asks for, so that one path (apiserver/serving_chat.py)
renders, constrains and parses both.

The input's items become chat messages: `instructions` a system message before them; an assistant message and
the function calls after it one assistant message with `tool_calls`; each function call output a tool message (its
call earlier in the input, as OpenAI requires: nothing is stored here to find it in); a
reasoning item the `reasoning_content` of the assistant turn after it (dropped when none follows). Tools, the tool
choice and `text.format` map field for field onto the chat request's tools, tool_choice and response_format.
"""
from __future__ import annotations

from apiserver.errors import InvalidRequest
from apiserver.protocol import (
    AllowedFunction, AllowedTools, AllowedToolsChoice, ChatCompletionRequest, ChatMessage, FunctionDefinition, FunctionName,
    JsonSchemaFormat, NamedToolChoice, ResponseFormat, Tool, ToolCall, ToolCallFunction,
)
from apiserver.protocol_responses import (
    AllowedFunctions, FunctionCallItem, FunctionCallOutputItem, MessageItem, ReasoningItem,
    ResponsesRequest, TextConfig,
)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_construct(
        model=req.model,
        messages=messages(req),
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        # The chat path bounds a whole answer's logprobs unless it streams; a Responses stream holds them too (its
        # last event is the whole response), so apiserver/serving_responses.py bounds them itself, streamed or
        # not, in this API's words, and the chat path is told it streams.
        stream=True,
        logprobs=req.wants_logprobs,
        top_logprobs=req.top_logprobs,
        tools=None if req.tools is None else [_tool(t) for t in req.tools],
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        reasoning_effort=None if req.reasoning is None else req.reasoning.effort,
        user=req.user,
    )


def messages(req: ResponsesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if req.instructions is not None:
        out.append(ChatMessage.model_construct(role="system", content=req.instructions))
    if isinstance(req.input, str):
        out.append(ChatMessage.model_construct(role="user", content=req.input))
        return out
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
    calls: set[str] = set()  # the call_ids of the function calls so far
    for index, item in enumerate(req.input):
        if isinstance(item, ReasoningItem):
            reasoning = _reasoning_text(item)
        elif isinstance(item, MessageItem):
            message = ChatMessage.model_construct(role=item.role, content=_text(item.content))
            if item.role == "assistant":
                message.reasoning_content, reasoning = reasoning, None
            out.append(message)
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = ToolCall.model_construct(id=item.call_id, type="function", function=ToolCallFunction.model_construct(
                name=item.name, arguments=item.arguments))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or ()), call]  # the calls of the turn this message began
            else:
                out.append(ChatMessage.model_construct(role="assistant", content=None, tool_calls=[call],
                                                       reasoning_content=reasoning))
                reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:  # (nothing is stored here: its call must be in this input, before it)
                raise InvalidRequest(f"No tool call found for function call output with call_id `{item.call_id}`: "
                                     f"a `function_call` item with that call_id must come before it in `input`.",
                                     param=f"input.{index}.call_id")
            out.append(ChatMessage.model_construct(role="tool", content=_text(item.output),
                                                   tool_call_id=item.call_id))
        else:  # the model's discriminator admits no other item
            raise InvalidRequest(f"Invalid value for `input.{index}`: an item of an unknown type.",
                                 param=f"input.{index}")
    if not out:
        raise InvalidRequest("`input` holds no message: reasoning needs the assistant turn it led to.", param="input")
    return out


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.refusal if part.type == "refusal" else part.text for part in content)


def _reasoning_text(item: ReasoningItem) -> str:
    """Its full text where the item has it, else its summary's."""
    parts = item.content if item.content else item.summary
    return "\n".join(part.text for part in parts)


def _tool(tool) -> Tool:
    return Tool.model_construct(type="function", function=FunctionDefinition.model_construct(
        **tool.model_dump(exclude={"type"})))


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, AllowedFunctions):
        allowed = [AllowedFunction.model_construct(type="function", function=FunctionName.model_construct(name=f.name))
                   for f in choice.tools]
        return AllowedToolsChoice.model_construct(type="allowed_tools", allowed_tools=AllowedTools.model_construct(
            mode=choice.mode, tools=allowed))
    return NamedToolChoice.model_construct(type="function", function=FunctionName.model_construct(name=choice.name))


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat.model_construct(type="json_object", json_schema=None)
    return ResponseFormat.model_construct(type="json_schema", json_schema=JsonSchemaFormat.model_construct(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))
