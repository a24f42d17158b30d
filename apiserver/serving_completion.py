"""POST /v1/completions: a prompt (text or token ids, one or a batch) to the engine, and back as a
`text_completion` body or a stream of them. With a batch, choice `i * n + j` is prompt i's j-th sample.

`echo` puts the prompt's text before each choice's; with `logprobs` too, the engine computes prompt logprobs and
the choice's logprobs cover the prompt tokens (the first one's null) and then the generated ones, with text
offsets into the echoed text plus the generated text (as OpenAI's legacy completions and vLLM do). `max_tokens`
0 is allowed with echo only: the prompt (and its logprobs) alone, which is what loglikelihood evaluations send."""
from __future__ import annotations

import time

import orjson
from starlette.requests import Request

from apiserver.chunks import ChunkWriterBase, chunk_head, with_stream_options
from apiserver.errors import InvalidRequest
from apiserver.detokenizer import generated_text_completes_the_prompt
from apiserver.generation import Delta, Generation
from apiserver.logprobs import LogprobFormatter, TextOffsets
from apiserver.prompt_offload import decode, encode
from apiserver.protocol import CompletionRequest
from apiserver.sampling_params import (
    check_echo, check_whole_logprobs, max_tokens_for, sampling_params, stop_strings, truncated,
)
from apiserver.serving import GenerationServing
from apiserver.structured_outputs import checked, requested_grammar
from apiserver.usage import usage
from apiserver.validation import parse_request_body, request_body

MAX_PROMPTS = 256


class CompletionServing(GenerationServing):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.logprobs = LogprobFormatter(ctx.renderer.tokenizer)

    async def prompts(self, prompt) -> tuple[list[list[int]], list[str | None]]:
        """Each prompt's token ids, and its text where the client sent text (for echo)."""
        if not prompt:
            raise InvalidRequest("`prompt` is empty.", param="prompt")
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        if isinstance(prompt[0], str):
            texts = prompt
            token_prompts = await encode(self.ctx.renderer, texts)
        else:
            texts = [None] * len(prompt)
            token_prompts = prompt
        vocab = self.ctx.model.vocab_size
        for ids in token_prompts:
            if not ids:
                raise InvalidRequest("A prompt encodes to no tokens at all.", param="prompt")
            if max(ids) >= vocab:
                raise InvalidRequest(f"Token id {max(ids)} is outside the vocabulary (size {vocab}).", param="prompt")
        return token_prompts, texts

    async def create(self, request: Request, body: bytes | None = None):
        """`body`: the request's, as a caller rewrote it (/invocations fills in the model)."""
        req = await parse_request_body(CompletionRequest, body if body is not None else await request_body(request))
        self.check_model(req.model)
        self.check_engine()
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest("`max_tokens` must be at least 1 (0 only with `echo`).", param="max_tokens")
        ctx = self.ctx
        grammar = await requested_grammar(req, ctx.grammars, ctx.config.max_structured_output_choices)
        grammar_param = None
        if grammar is not None:
            grammar_param = "response_format" if req.structured_outputs is None else "structured_outputs"
            grammar = await checked(grammar, grammar_param, ctx.grammars)
        prompts, texts = await self.prompts(req.prompt)
        max_model_len = ctx.model.max_model_len
        if req.truncate_prompt_tokens is not None:  # an echo then shows the tokens kept, as their text
            kept = [truncated(p, req.truncate_prompt_tokens, max_model_len) for p in prompts]
            texts = [t if len(k) == len(p) else None for t, k, p in zip(texts, kept, prompts)]
            prompts = kept
        # OpenAI's default of 16 is a budget the client did not ask for: a long prompt shrinks it to the room it
        # leaves (as vLLM's does) rather than being refused for tokens nobody requested.
        implicit = "max_tokens" not in req.model_fields_set
        requested = None if implicit else req.max_tokens
        max_tokens = min(max_tokens_for(len(p), requested, max_model_len, "prompt") for p in prompts)
        if implicit:
            max_tokens = min(max_tokens, req.max_tokens)
        if req.echo:
            check_echo(req.n, sum(len(p) for p in prompts), ctx.config.max_echo_tokens)
        top_n = req.logprobs or 0
        echo_logprobs = req.echo and req.logprobs is not None
        if req.logprobs is not None and not req.stream:
            check_whole_logprobs(len(prompts) * req.n, max_tokens, top_n,
                                 sum(len(p) for p in prompts) if echo_logprobs else 0, ctx.config.max_logprob_entries,
                                 "logprobs")
        sampling = sampling_params(req, ctx.model.generation_defaults, max_tokens, req.logprobs, ctx.model.vocab_size,
                                   prompt_logprobs=req.logprobs if echo_logprobs else None, grammar=grammar,
                                   max_logit_bias_entries=ctx.config.max_logit_bias_entries)
        request_id = self.request_id(request, req.request_id)
        generation = Generation(
            ctx.engine, request_id, prompts, sampling, self.priority(request, req.priority),
            stop_strings(req.stop, ctx.config), req.skip_special_tokens, req.include_stop_str_in_output,
            ctx.renderer.tokenizer, self.data_parallel_rank(request, req.data_parallel_rank), grammar_param=grammar_param,
            eos_token_ids=ctx.model.eos_token_ids,
        )
        generates = req.max_tokens != 0
        echoes = [await self._echo_text(p, t, generates) for p, t in zip(prompts, texts)] if req.echo else None
        response_id = "cmpl-" + request_id
        created = int(time.time())
        options = req.stream_options
        writer = with_stream_options(CompletionChunkWriter(self, response_id, created, top_n, echoes, echo_logprobs),
                                     options, generation, self.ctx.config)
        return await self.respond(
            request, generation, req.stream, writer, bool(options and options.include_usage),
            lambda gen, deltas: self.whole_body(gen, deltas, response_id, created, top_n, echoes),
        )

    async def _echo_text(self, prompt_ids: list[int], text: str | None, generates: bool) -> str:
        """The prompt as its client sent it; or, sent as token ids, their text, less a character they end inside
        of when tokens follow: the generated text begins with it whole (detokenizer.py), and the echo and the
        answer together are then the text of prompt and answer as one."""
        if text is not None:
            return text
        echo = await decode(self.ctx.renderer, prompt_ids, skip_special_tokens=False)
        if generates and echo.endswith("\ufffd") and generated_text_completes_the_prompt(self.ctx.renderer.tokenizer,
                                                                                           prompt_ids):
            return echo[:-1]
        return echo

    def whole_body(self, generation: Generation, deltas: list[Delta], response_id: str, created: int, top_n: int,
                   echoes) -> dict:
        choices = []
        for delta in deltas:
            text = delta.text
            entries = delta.logprobs
            if echoes is not None:
                text = echoes[delta.prompt_index] + text
                if entries is not None:
                    entries = (delta.prompt_logprobs or []) + entries
            choices.append({
                "index": delta.index,
                "text": text,
                "logprobs": None if entries is None else self.logprobs.completion(entries, top_n,
                                                                                  self.logprobs.offsets()),
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            })
        return {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage(generation, self.ctx.config),
        }


class CompletionChunkWriter(ChunkWriterBase):
    """Streamed `text_completion` events: the echoed prompts first (with echo), then each choice's text. With
    echo and logprobs, a choice's echo event waits for its prompt logprobs (they come with its first output)."""

    def __init__(self, serving: CompletionServing, response_id: str, created: int, top_n: int, echoes,
                 echo_logprobs: bool = False):
        ctx = serving.ctx
        super().__init__(chunk_head(response_id, b"text_completion", created, ctx.model_name), ctx.config)
        self._logprobs = serving.logprobs
        self._top_n = top_n
        self._echoes = echoes
        self._echo_logprobs = echo_logprobs
        self._text_offsets: dict[int, TextOffsets] = {}  # choice index -> where its next token's text starts

    def first(self, generation: Generation) -> bytes:
        if self._echoes is None or self._echo_logprobs:
            return b""
        return b"".join(
            self.event(choice.index, self._echoes[choice.prompt_index], b"null", b',"finish_reason":null')
            for choice in generation.choices
        )

    def event(self, index: int, text: str, logprobs: bytes, tail: bytes) -> bytes:
        return self._head + b'{"index":%d,"text":%b,"logprobs":%b%b}]}\n\n' % (index, orjson.dumps(text), logprobs, tail)

    def changes(self, deltas: list[Delta]) -> bytes:
        if not self._echo_logprobs:
            return super().changes(deltas)
        echoed = []
        for delta in deltas:
            if delta.prompt_logprobs is not None:
                logprobs = self._logprobs_json(delta.index, delta.prompt_logprobs)
                echoed.append(self.event(delta.index, self._echoes[delta.prompt_index], logprobs,
                                         b',"finish_reason":null'))
        return b"".join(echoed) + super().changes(deltas)

    def logprobs_json(self, delta: Delta) -> bytes:
        return self._logprobs_json(delta.index, delta.logprobs)

    def _logprobs_json(self, index: int, entries: list) -> bytes:
        offsets = self._text_offsets.get(index)
        if offsets is None:
            offsets = self._text_offsets[index] = self._logprobs.offsets()
        return orjson.dumps(self._logprobs.completion(entries, self._top_n, offsets))
