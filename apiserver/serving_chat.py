"""POST /v1/chat/completions: messages through the chat template to the engine, and back as a
`chat.completion` body or a stream of `chat.completion.chunk` events.

A request with tools (apiserver/tool_choice.py), or a server with a reasoning parser, has its choices' text read
into reasoning, content and tool calls (apiserver/chat_output.py); a plain one streams its text as it is. A stream
sends each choice's `role` with its first generated text, not before the prompt is computed: a client timing the
first chunk then times the first token, as with vLLM."""
from __future__ import annotations

import time
from typing import NamedTuple

import orjson
from starlette.requests import Request

from apiserver.chat_messages import content_text
from apiserver.chat_output import OutputShape, StreamedMessage, message
from apiserver.chunks import ChunkWriterBase, chunk_head, with_stream_options
from apiserver.errors import InvalidRequest
from apiserver.generation import Delta, Generation
from apiserver.logprobs import LogprobFormatter
from apiserver.prompt_offload import render_chat
from apiserver.protocol import ChatCompletionRequest
from apiserver.reasoning import START, ReasoningParser
from apiserver.sampling_params import (
    check_whole_logprobs, max_tokens_for, sampling_params, stop_strings, truncated,
)
from apiserver.serving import GenerationServing
from apiserver.structured_outputs import checked, requested_grammar, schema_grammar
from apiserver.tool_choice import tool_plan
from apiserver.usage import usage
from apiserver.validation import parse_request_body, request_body


class Prepared(NamedTuple):
    generation: Generation
    shape: OutputShape | None  # None: the text as it is (no tools, no reasoning parser)
    top_n: int  # top logprobs per token


# How much of the prompt's end to decode to see whether the chat template opened the reasoning.
_PROMPT_TAIL_TOKENS = 4


class ChatServing(GenerationServing):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.logprobs = LogprobFormatter(ctx.renderer.tokenizer)
        name = ctx.config.reasoning_parser
        start_tokens = ctx.renderer.encode(START, add_special_tokens=False) if name else ()
        self.reasoning = ReasoningParser(name, len(start_tokens) == 1) if name else None

    async def create(self, request: Request, body: bytes | None = None):
        """`body`: the request's, as a caller rewrote it (/invocations fills in the model)."""
        req = await parse_request_body(ChatCompletionRequest, body if body is not None else await request_body(request))
        generation, shape, top_n = await self.prepare(request, req)
        response_id = "chatcmpl-" + generation.request_id
        created = int(time.time())
        options = req.stream_options
        if shape is None:
            writer = ChatChunkWriter(self, response_id, created, top_n)
        else:
            writer = ShapedChatChunkWriter(self, response_id, created, top_n, shape)
        writer = with_stream_options(writer, options, generation, self.ctx.config)
        return await self.respond(
            request, generation, req.stream, writer, bool(options and options.include_usage),
            lambda gen, deltas: self.whole_body(gen, deltas, response_id, created, top_n, shape),
        )

    async def prepare(self, request: Request, req: ChatCompletionRequest) -> Prepared:
        """The checked request's generation (not started), and how to read its text (also the Responses API's:
        apiserver/serving_responses.py)."""
        self.check_model(req.model)
        self.check_engine()
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
        ctx = self.ctx
        tools = tool_plan(req, ctx.config)
        if tools.schema is not None and req.structured_outputs is not None:
            raise InvalidRequest("A `tool_choice` that forces a call cannot be combined with `structured_outputs`.",
                                 param="tool_choice")
        # A forced call's grammar wins over `response_format`, as in vLLM: that format is for the answer that comes
        # after the call (openai-agents sends both, then lets the choice go once the tool has run).
        grammar = None if tools.schema is not None else await requested_grammar(
            req, ctx.grammars, ctx.config.max_structured_output_choices)
        prompt = await render_chat(
            ctx.renderer,
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            template_kwargs(req, ctx.renderer),
            tools=tools.template_tools,
        )
        prompt = truncated(prompt, req.truncate_prompt_tokens, ctx.model.max_model_len)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = max_tokens_for(len(prompt), requested, ctx.model.max_model_len, "messages")
        continued = content_text(req.messages[-1]) if req.continue_final_message else None
        shape = self._output_shape(prompt, tools.parser, continued)
        if tools.schema is not None:
            grammar = await schema_grammar(tools.schema, ctx.grammars, "tools")
        grammar_param = None
        if grammar is not None:
            if shape is not None and shape.reasoning:
                grammar = self.reasoning.constrain(grammar, shape.opened)
            grammar_param = ("tools" if tools.schema is not None else
                             "structured_outputs" if req.structured_outputs is not None else "response_format")
            grammar = await checked(grammar, grammar_param, ctx.grammars)
        top_n = req.top_logprobs or 0
        if req.logprobs and not req.stream:
            check_whole_logprobs(req.n, max_tokens, top_n, 0, ctx.config.max_logprob_entries,
                                 "top_logprobs" if top_n else "logprobs")
        sampling = sampling_params(
            req, ctx.model.generation_defaults, max_tokens, top_n if req.logprobs else None, ctx.model.vocab_size,
            grammar=grammar, max_logit_bias_entries=ctx.config.max_logit_bias_entries,
        )
        request_id = self.request_id(request, req.request_id)
        generation = Generation(
            ctx.engine, request_id, [prompt], sampling, self.priority(request, req.priority),
            stop_strings(req.stop, ctx.config), req.skip_special_tokens, req.include_stop_str_in_output,
            ctx.renderer.tokenizer, self.data_parallel_rank(request, req.data_parallel_rank), grammar_param=grammar_param,
            eos_token_ids=ctx.model.eos_token_ids,
        )
        return Prepared(generation, shape, top_n)

    def _output_shape(self, prompt: list[int], tool_parser, continued: str | None) -> OutputShape | None:
        """How to read the choices' text; None: as it is. `continued`: the final message's text, when the output
        continues it."""
        if self.reasoning is None and tool_parser is None:
            return None
        opened = False
        if self.reasoning is not None:
            tail = self.ctx.renderer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            opened = self.reasoning.opened_by(tail, continued)
        return OutputShape(self.reasoning is not None, opened, tool_parser)

    def whole_body(self, generation: Generation, deltas: list[Delta], response_id: str, created: int,
                   top_n: int, shape: OutputShape | None = None) -> dict:
        choices = []
        for delta in deltas:
            finish_reason = delta.finish_reason
            if shape is None:
                msg = {"role": "assistant", "content": delta.text}
            else:
                msg, finish_reason = message(delta.text, shape, finish_reason)
            choices.append({
                "index": delta.index,
                "message": msg,
                "logprobs": None if delta.logprobs is None else {"content": self.logprobs.chat(delta.logprobs, top_n)},
                "finish_reason": finish_reason,
                "stop_reason": delta.stop_reason,
            })
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage(generation, self.ctx.config),
        }


class ChatChunkWriter(ChunkWriterBase):
    """Streamed `chat.completion.chunk` events: each choice's deltas, its first one with the role."""

    def __init__(self, serving: ChatServing, response_id: str, created: int, top_n: int):
        ctx = serving.ctx
        super().__init__(chunk_head(response_id, b"chat.completion.chunk", created, ctx.model_name), ctx.config)
        self._logprobs = serving.logprobs
        self._top_n = top_n
        self._roleless: set[int] = set()  # choices whose first event is still to come

    def first(self, generation: Generation) -> bytes:
        self._roleless = {choice.index for choice in generation.choices}
        return b""

    def event(self, index: int, text: str, logprobs: bytes, tail: bytes) -> bytes:
        if index in self._roleless:
            self._roleless.discard(index)
            delta = b'{"role":"assistant","content":' + orjson.dumps(text) + b"}"
        else:
            delta = b'{"content":' + orjson.dumps(text) + b"}" if text else b"{}"
        return self._head + b'{"index":%d,"delta":%b,"logprobs":%b%b}]}\n\n' % (index, delta, logprobs, tail)

    def logprobs_json(self, delta: Delta) -> bytes:
        return orjson.dumps({"content": self._logprobs.chat(delta.logprobs, self._top_n)})


class ShapedChatChunkWriter(ChatChunkWriter):
    """Streamed chunks of choices read into reasoning, content and tool calls: each delta carries what grew."""

    def __init__(self, serving: ChatServing, response_id: str, created: int, top_n: int, shape: OutputShape):
        super().__init__(serving, response_id, created, top_n)
        self._shape = shape
        self._messages: dict[int, StreamedMessage] = {}

    def changes(self, deltas: list[Delta]) -> bytes:
        events = []
        for delta in deltas:
            streamed = self._messages.get(delta.index)
            if streamed is None:
                streamed = self._messages[delta.index] = StreamedMessage(self._shape)
            finish = delta.finish_reason
            fields = streamed.feed(delta.text, finish is not None)
            logprobs = self.logprobs_json(delta) if delta.logprobs else b"null"
            if not fields and finish is None and logprobs == b"null":
                continue
            if delta.index in self._roleless:
                self._roleless.discard(delta.index)
                fields = {"role": "assistant", **fields}
            if finish is None:
                tail = b',"finish_reason":null'
            else:
                if finish == "stop" and streamed.calls_tools:
                    finish = "tool_calls"
                tail = b',"finish_reason":' + orjson.dumps(finish) + b',"stop_reason":' + orjson.dumps(delta.stop_reason)
            events.append(self._head + b'{"index":%d,"delta":%b,"logprobs":%b%b}]}\n\n'
                          % (delta.index, orjson.dumps(fields), logprobs, tail))
        return b"".join(events)


def template_kwargs(req: ChatCompletionRequest, renderer) -> dict | None:
    """The request's chat_template_kwargs, with `reasoning_effort` as the template's variable of that name (as
    vLLM passes it): only a template that reads one can honour it."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    if not renderer.template_reads("reasoning_effort"):
        raise InvalidRequest("`reasoning_effort` is not supported for this model: its chat template reads no "
                             "reasoning effort.", param="reasoning_effort")
    kwargs = dict(req.chat_template_kwargs or {})
    if kwargs.setdefault("reasoning_effort", req.reasoning_effort) != req.reasoning_effort:
        raise InvalidRequest("`reasoning_effort` and `chat_template_kwargs.reasoning_effort` differ: give one.",
                             param="reasoning_effort")
    return kwargs
