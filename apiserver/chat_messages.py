"""A chat request's messages as chat templates expect them (dicts, as transformers hands them over).

The check that a tool message names its call is made here, in one plain loop, rather than by a pydantic validator
on each message: that validator was a Python call per message inside the body's parse, a quarter of the event
loop's time on a body of 250,000 messages (the parse of one body cannot be split, so its cost is the loop's)."""
from __future__ import annotations

import json

from apiserver.errors import InvalidRequest
from apiserver.protocol import ChatMessage


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Each message as `message_dict` gives it; a 400 for a tool message without `tool_call_id`, and for a message
    without content that is not the assistant's (OpenAI's rule: only an assistant's turn, which may be tool calls
    alone, may come without it; a null user message had been read as an empty one)."""
    dicts = []
    for index, message in enumerate(messages):
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidRequest(f"Invalid value for `messages.{index}`: a tool message needs `tool_call_id`.",
                                 param=f"messages.{index}")
        if (message.content is None or message.content == []) and message.role != "assistant":
            raise InvalidRequest(f"Invalid value for `messages.{index}.content`: a {message.role} message needs "
                                 f"content (a string or a list of one or more text parts), not null, nothing or "
                                 f"an empty list.", param=f"messages.{index}.content")
        dicts.append(message_dict(message))
    return dicts


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates expect it: a string content, `developer` as `system`, tool calls with their
    arguments as objects (as vLLM hands them to templates, which write them with `tojson`)."""
    content = content_text(message)
    role = "system" if message.role == "developer" else message.role
    out: dict = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [_call_dict(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def content_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined by newlines, none as "")."""
    content = message.content
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _call_dict(call) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
