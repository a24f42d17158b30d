"""The `response` object of the Responses API, whole or as its stream's events show it: what the request asked
(echoed, as OpenAI does), the output items, the status and the usage.

The output of one choice is its reasoning (a `reasoning` item), its content (a `message` item with one
`output_text` part) and its tool calls (a `function_call` item each), in that order. A response cut off by
`max_output_tokens` is `incomplete`, its last item too. Logprobs, when asked, are the `output_text` part's, in the
chat API's form (apiserver/logprobs.py).
"""
from __future__ import annotations

import time

from apiserver.generation import Generation
from apiserver.logprobs import LogprobFormatter
from apiserver.protocol_responses import ResponsesRequest
from ipc.sampling import SamplingParams

INCOMPLETE_DETAILS = {"reason": "max_output_tokens"}


class ResponseFrame:
    """One response's fixed fields, and its items' ids."""

    def __init__(self, req: ResponsesRequest, request_id: str, model_name: str, sampling: SamplingParams):
        self.request_id = request_id
        self.id = "resp_" + request_id
        self._fields = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model_name,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            # What was sampled with (the request's, else the model's generation_config.json's, else 1), as OpenAI
            # and vLLM echo it: not null where the request left them out.
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "tools": [] if req.tools is None else [tool.model_dump(exclude_none=True) for tool in req.tools],
            "tool_choice": _choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"} if req.text is None or req.text.format is None
                     else req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": _reasoning(req),
            "truncation": "disabled",
            "previous_response_id": None,
            "store": False,  # whatever the request said: nothing is kept
            "background": False,
            "user": req.user,
            "metadata": req.metadata or {},
            "top_logprobs": req.top_logprobs,
            "error": None,
        }

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"

    def response(self, status: str, output: list[dict], response_usage: dict | None = None) -> dict:
        return {
            **self._fields,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "incomplete_details": INCOMPLETE_DETAILS if status == "incomplete" else None,
            "output": output,
            "usage": response_usage,
        }


def _reasoning(req: ResponsesRequest) -> dict:
    asked = req.reasoning
    if asked is None:
        return {"effort": None, "summary": None}
    return {"effort": asked.effort, "summary": asked.summary or asked.generate_summary}


def _choice(choice) -> str | dict:
    if choice is None:
        return "auto"  # OpenAI's default, with tools or without
    return choice if isinstance(choice, str) else choice.model_dump()


class ResponseLogprobs:
    """A response's logprobs as its `output_text` part lists them, `top_n` likeliest tokens with each."""

    def __init__(self, formatter: LogprobFormatter, top_n: int):
        self._formatter = formatter
        self._top_n = top_n

    def of(self, entries: list | None) -> list[dict]:
        """`entries`: the engine's, as a Delta holds them."""
        return self._formatter.chat(entries, self._top_n) if entries else []


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(frame: ResponseFrame, fields: dict, status: str, logprobs: list[dict] | None = None) -> list[dict]:
    """A whole answer's items from its message fields (apiserver.chat_output.message's, or the plain text's
    `content`); `logprobs`: its text's, when asked."""
    items: list[dict] = []
    if fields.get("reasoning_content"):
        items.append(reasoning_item(frame.item_id("rs", len(items)), fields["reasoning_content"]))
    if fields.get("content"):
        items.append(message_item(frame.item_id("msg", len(items)), fields["content"], logprobs=logprobs))
    for call in fields.get("tool_calls") or ():
        function = call["function"]
        items.append(call_item(frame.item_id("fc", len(items)), call["id"], function["name"], function["arguments"]))
    if items and status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed",
                 logprobs: list[dict] | None = None) -> dict:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_text(output: list[dict]) -> str:
    return "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])


def response_usage(generation: Generation, reasoning_tokens: int) -> dict:
    prompt, completion = generation.num_prompt_tokens, generation.num_completion_tokens
    return {
        "input_tokens": prompt,
        # cache_write_tokens: input written to a cache kept for a price and a time (OpenAI's extended retention);
        # the prefix cache here keeps what it can for free, as OpenAI's automatic caching, which writes none.
        # The openai package (3.63) declares the field required.
        "input_tokens_details": {"cached_tokens": generation.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }
