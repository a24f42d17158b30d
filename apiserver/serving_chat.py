"""POST /v1/chat/completions: messages through the chat template to the engine, and back as a
`chat.completion` body or a stream of `chat.completion.chunk` events."""
from __future__ import annotations

import time

import orjson
from starlette.requests import Request

from apiserver.chunks import ChunkWriterBase, chunk_head
from apiserver.errors import InvalidRequest
from apiserver.generation import Delta, Generation
from apiserver.logprobs import LogprobFormatter
from apiserver.prompt_offload import render_chat
from apiserver.protocol import ChatCompletionRequest, ChatMessage
from apiserver.sampling_params import max_tokens_for, sampling_params, stop_strings
from apiserver.serving import GenerationServing
from apiserver.usage import usage
from apiserver.validation import parse_body


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates expect it: a string content, `developer` as `system`."""
    content = message.content
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = "\n".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    return out


class ChatServing(GenerationServing):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.logprobs = LogprobFormatter(ctx.renderer.tokenizer)

    async def create(self, request: Request):
        req = parse_body(ChatCompletionRequest, await request.body())
        self.check_model(req.model)
        self.check_engine()
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
        ctx = self.ctx
        prompt = await render_chat(
            ctx.renderer,
            [message_dict(m) for m in req.messages],
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = max_tokens_for(len(prompt), requested, ctx.model.max_model_len, "messages")
        top_n = req.top_logprobs or 0
        sampling = sampling_params(
            req, ctx.model.generation_defaults, max_tokens, top_n if req.logprobs else None, ctx.model.vocab_size
        )
        request_id = self.request_id(request, req.request_id)
        generation = Generation(
            ctx.engine, request_id, [prompt], sampling, self.priority(request, req.priority), stop_strings(req.stop),
            req.skip_special_tokens, req.include_stop_str_in_output, ctx.renderer.tokenizer,
        )
        response_id = "chatcmpl-" + request_id
        created = int(time.time())
        options = req.stream_options
        writer = ChatChunkWriter(self, response_id, created, top_n)
        return await self.respond(
            request, generation, req.stream, writer, bool(options and options.include_usage),
            lambda gen, deltas: self.whole_body(gen, deltas, response_id, created, top_n),
        )

    def whole_body(self, generation: Generation, deltas: list[Delta], response_id: str, created: int,
                   top_n: int) -> dict:
        choices = []
        for delta in deltas:
            choices.append({
                "index": delta.index,
                "message": {"role": "assistant", "content": delta.text},
                "logprobs": None if delta.logprobs is None else {"content": self.logprobs.chat(delta.logprobs, top_n)},
                "finish_reason": delta.finish_reason,
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
    """Streamed `chat.completion.chunk` events: a first one with the role, then each choice's delta."""

    def __init__(self, serving: ChatServing, response_id: str, created: int, top_n: int):
        ctx = serving.ctx
        super().__init__(chunk_head(response_id, b"chat.completion.chunk", created, ctx.model_name), ctx.config)
        self._logprobs = serving.logprobs
        self._top_n = top_n

    def first(self, generation: Generation) -> bytes:
        head = self._head
        return b"".join(
            head + b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            % choice.index
            for choice in generation.choices
        )

    def event(self, index: int, text: str, logprobs: bytes, tail: bytes) -> bytes:
        delta = b'{"content":' + orjson.dumps(text) + b"}" if text else b"{}"
        return self._head + b'{"index":%d,"delta":%b,"logprobs":%b%b}]}\n\n' % (index, delta, logprobs, tail)

    def logprobs_json(self, delta: Delta) -> bytes:
        return orjson.dumps({"content": self._logprobs.chat(delta.logprobs, self._top_n)})
