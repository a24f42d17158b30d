"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the model's tokenizer, without generating."""
from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from apiserver.errors import InvalidRequest
from apiserver.hf_tokenizer import DEFAULT_TEMPLATE
from apiserver.prompt_offload import decode, encode, render_chat, token_strings
from apiserver.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from apiserver.serving import GenerationServing
from apiserver.tool_choice import tools_for_template
from apiserver.validation import parse_body, parse_request_body, parsing, request_body


def _json(body) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _tokenize_request(body: bytes) -> TokenizeChatRequest | TokenizeCompletionRequest:
    try:
        is_chat = b'"messages"' in body and "messages" in orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError):
        is_chat = False  # parse_body below says what is wrong
    return parse_body(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)


class TokenizeServing(GenerationServing):
    def __init__(self, ctx, chat):
        super().__init__(ctx)
        self._chat = chat

    async def tokenize(self, request: Request) -> Response:
        body = await request_body(request)
        async with parsing(body):
            req = _tokenize_request(body)
        renderer = self.ctx.renderer
        if isinstance(req, TokenizeChatRequest):
            self.check_model(req.model)
            tools = tools_for_template(req.tools) if req.tools else None
            tokens = await render_chat(
                renderer, req.messages, req.add_generation_prompt,
                req.continue_final_message, req.chat_template_kwargs, req.add_special_tokens, tools,
            )
        else:
            self.check_model(req.model)
            tokens = (await encode(renderer, [req.prompt], req.add_special_tokens))[0]
        strings = await token_strings(renderer, tokens) if req.return_token_strs else None
        return _json({"count": len(tokens), "max_model_len": self.ctx.model.max_model_len, "tokens": tokens,
                      "token_strs": strings})

    async def detokenize(self, request: Request) -> Response:
        req = await parse_request_body(DetokenizeRequest, await request_body(request))
        self.check_model(req.model)
        vocab = self.ctx.model.vocab_size
        if req.tokens and max(req.tokens) >= vocab:
            raise InvalidRequest(f"Token id {max(req.tokens)} is outside the vocabulary (size {vocab}).", param="tokens")
        return _json({"prompt": await decode(self.ctx.renderer, req.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: Request) -> Response:
        hf = self.ctx.renderer.hf_tokenizer
        special = hf.special_tokens
        templates = hf.chat_templates
        return _json({
            "tokenizer_class": hf.tokenizer_class,
            "vocab_size": self.ctx.model.vocab_size,
            "model_max_length": self.ctx.model.max_model_len,
            "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"),
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "eos_token_ids": list(self.ctx.model.eos_token_ids),
            "added_tokens": {str(i): t.content for i, t in sorted(hf.added_tokens_decoder.items())},
            # The one --chat-template gave; else one template as its text, several by name (as transformers'
            # `chat_template` attribute holds them).
            "chat_template": self.ctx.config.chat_template or (
                templates.get(DEFAULT_TEMPLATE) if list(templates) == [DEFAULT_TEMPLATE] else templates or None),
        })
