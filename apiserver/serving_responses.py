"""POST /v1/responses: OpenAI's Responses API, stateless. The request is read as the chat completion it asks for
(apiserver/responses_input.py) and goes the chat path (apiserver/serving_chat.py: the template, tools, structured
outputs, the reasoning parser); the answer is a `response` object (apiserver/responses_output.py) or a stream of
its typed events (apiserver/responses_stream.py). Nothing is stored: there is no GET, cancel or delete of a
response, and no `previous_response_id`."""
from __future__ import annotations

import re

from starlette.requests import Request

from apiserver.chat_output import message
from apiserver.errors import ApiError, InvalidRequest
from apiserver.generation import Delta, Generation
from apiserver.protocol_responses import LOGPROBS_INCLUDE, ResponsesRequest
from apiserver.responses_input import chat_request
from apiserver.responses_output import (
    ResponseFrame, ResponseLogprobs, output_items, reasoning_text, response_usage, status_of,
)
from apiserver.responses_stream import ResponseEventWriter
from apiserver.sampling_params import check_whole_logprobs
from apiserver.serving_chat import ChatServing
from apiserver.validation import parse_request_body, request_body


# The chat request's fields that errors from the chat path name, as this request calls them.
_FIELD_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens",
                "max_completion_tokens": "max_output_tokens", "messages": "input",
                "reasoning_effort": "reasoning.effort"}


class ResponsesServing:
    def __init__(self, chat: ChatServing):
        self._chat = chat
        self.ctx = chat.ctx

    async def create(self, request: Request):
        try:
            req = await parse_request_body(ResponsesRequest, await request_body(request))
        except ApiError as exc:
            raise _without_format_tag(exc) from None
        try:
            generation, shape, top_n = await self._chat.prepare(request, chat_request(req))
        except ApiError as exc:
            raise _renamed(exc) from None
        logprobs = None
        if req.wants_logprobs:
            self._check_logprobs(req, generation, shape, top_n)
            logprobs = ResponseLogprobs(self._chat.logprobs, top_n)
        frame = ResponseFrame(req, generation.request_id, self.ctx.model_name, generation.sampling)
        writer = ResponseEventWriter(frame, shape, self.count_tokens, logprobs)
        return await self._chat.respond(
            request, generation, req.stream, writer, False,
            lambda gen, deltas: self.whole_body(gen, deltas, frame, shape, logprobs),
        )

    def _check_logprobs(self, req: ResponsesRequest, generation: Generation, shape, top_n: int) -> None:
        """400 unless the asked logprobs can be given, and held: streamed or not, the last event is the whole
        response, logprobs and all."""
        param = "top_logprobs" if req.top_logprobs else "include"
        check_whole_logprobs(1, generation.sampling.max_tokens, top_n, 0, self.ctx.config.max_logprob_entries,
                             param, "Ask for fewer tokens (max_output_tokens) or top logprobs (top_logprobs).")
        if shape is not None:
            # Which tokens were reasoning or a call's is known only as text: logprobs for the answer's text alone
            # would be a guess at a token boundary.
            raise InvalidRequest(
                f"`{LOGPROBS_INCLUDE}` is given here only for answers read as plain text, not where a reasoning "
                "parser (--reasoning-parser) or tools split the output; chat completions give logprobs for every "
                "token of it.", param=param)

    def whole_body(self, generation: Generation, deltas: list[Delta], frame: ResponseFrame, shape,
                   logprobs: ResponseLogprobs | None) -> dict:
        delta = deltas[0]  # one choice: the Responses API has no `n`
        fields = {"content": delta.text} if shape is None else message(delta.text, shape, delta.finish_reason)[0]
        status = status_of(delta.finish_reason)
        entries = None if logprobs is None else logprobs.of(delta.logprobs)
        output = output_items(frame, fields, status, entries)
        return frame.response(status, output, response_usage(generation, self.count_tokens(reasoning_text(output))))

    def count_tokens(self, text: str) -> int:
        """The reasoning's tokens, for the usage: the engine counts the output's tokens, not which were
        reasoning."""
        renderer = self.ctx.renderer  # None only in a gRPC API server, which has no such route
        return len(renderer.encode(text, add_special_tokens=False)) if text and renderer is not None else 0


# pydantic puts the branch of `text.format` (its `type`) in an error's location: `text.format.json_schema.name`.
_FORMAT_TAG = re.compile(r"\btext\.format\.(?:text|json_object|json_schema)\b")


def _without_format_tag(error: ApiError) -> ApiError:
    """`error` naming the field where the request has it: `text.format.name` (the format's fields sit in it)."""
    if error.param and _FORMAT_TAG.match(error.param):
        error.param = _FORMAT_TAG.sub("text.format", error.param)
        error.message = _FORMAT_TAG.sub("text.format", error.message)
    return error


def _renamed(error: ApiError) -> ApiError:
    """`error` naming this request's fields. A chat message's index is not an input item's (instructions come
    first, calls join their message): `messages.N` is all of `input`."""
    name = _FIELD_NAMES.get((error.param or "").partition(".")[0])
    if name is not None:
        error.param = name
        for chat_name, own_name in _FIELD_NAMES.items():
            error.message = error.message.replace(f"`{chat_name}`", f"`{own_name}`")
    return error
