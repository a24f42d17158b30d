"""The renderer's work on large inputs, off the event loop, so one big prompt never stalls the others.

Tokenizing costs about 0.2-0.5 us per character here (1 MB: 0.5 s; 10 MB: long enough for the watchdog to
take the server for dead), and `tokenizers.Tokenizer.encode` keeps the GIL while it runs, so a thread alone
would not free the loop: its `encode_batch_fast` releases the GIL, and gives the same ids. So inputs of
OFFLOAD_MIN_CHARS characters or more are rendered and tokenized in a worker thread with it (measured: the loop
then goes on with at most a few ms of delay while 1 MB is tokenized beside it, against the whole 0.5 s
inline). Smaller ones stay inline: a thread hop costs ~25 us plus a wake-up of the loop, more than tokenizing
a short prompt, and inline the renderer's segment cache serves the pieces every request repeats (a system
prompt of up to 8 KB); below the threshold the loop is held for at most ~4 ms.
In the thread, long texts are encoded in pieces (apiserver.long_text): the tokenizer's working memory for one
whole text of 8 MB was 840 MB.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import orjson

from apiserver.chat_messages import message_dicts
from apiserver.protocol import ChatMessage
from apiserver.renderer import Renderer

OFFLOAD_MIN_CHARS = 16384
# Decoding costs ~0.25 us per token id (4 million, an 8 MB /detokenize: 1 s of the loop): from this many ids on it
# runs in the worker thread, by tokenizers' decode_batch, which lets go of the GIL (its decode does not).
OFFLOAD_MIN_IDS = 4096
# What a chat template writes around each message, at the least (`<|im_start|>user\n`...`<|im_end|>\n`), and
# about what its loop costs per message in characters tokenized: 512 messages of any length go to the thread.
_MESSAGE_CHARS = 32
# Few threads: huge prompts wait for each other here rather than each taking a core and its memory.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


def _ids(renderer: Renderer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return renderer.encode_long(texts, add_special_tokens)


async def _in_thread(function, *args):
    return await asyncio.get_running_loop().run_in_executor(_POOL, function, *args)


async def encode(renderer: Renderer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Each text's token ids, as `renderer.encode` gives them."""
    if sum(len(t) for t in texts) < OFFLOAD_MIN_CHARS:
        return [renderer.encode(t, add_special_tokens) for t in texts]
    return await _in_thread(_ids, renderer, texts, add_special_tokens)


async def decode(renderer: Renderer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """`renderer.decode`, in the worker thread for many ids."""
    if len(token_ids) < OFFLOAD_MIN_IDS:
        return renderer.decode(token_ids, skip_special_tokens)
    return await _in_thread(renderer.decode, token_ids, skip_special_tokens, True)


async def token_strings(renderer: Renderer, token_ids: list[int]) -> list[str | None]:
    """`renderer.token_strings`, in the worker thread for many ids (it holds the GIL, but the loop gets its turns
    every switch interval instead of waiting for the whole list)."""
    if len(token_ids) < OFFLOAD_MIN_IDS:
        return renderer.token_strings(token_ids)
    return await _in_thread(renderer.token_strings, token_ids)


def _chat_ids(renderer: Renderer, messages: list[ChatMessage], options: tuple, add_special_tokens: bool) -> list[int]:
    return _dict_ids(renderer, message_dicts(messages), options, add_special_tokens)


async def render_chat(renderer: Renderer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                      continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                      add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids for `messages`, as `renderer.render_chat` gives them (`add_special_tokens`:
    as /tokenize may ask, `renderer.encode` of the rendered text)."""
    options = (add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
    if len(messages) * _MESSAGE_CHARS >= OFFLOAD_MIN_CHARS:  # many messages: even making their dicts is work
        return await _in_thread(_chat_ids, renderer, messages, options, add_special_tokens)
    dicts = message_dicts(messages)
    if _template_input_size(dicts, tools, chat_template_kwargs) < OFFLOAD_MIN_CHARS:
        if add_special_tokens:
            return renderer.encode(renderer.chat_text(dicts, *options), True)
        return renderer.render_chat(dicts, *options)
    return await _in_thread(_dict_ids, renderer, dicts, options, add_special_tokens)


def _dict_ids(renderer: Renderer, dicts: list[dict], options: tuple, add_special_tokens: bool) -> list[int]:
    return _ids(renderer, [renderer.chat_text(dicts, *options)], add_special_tokens)[0]


def _template_input_size(messages: list[dict], tools: list[dict] | None, kwargs: dict | None) -> int:
    """About how much text the chat template gets: the messages' contents, and what else it renders, tools and
    tool calls (a request of short messages and 7.7 MB of tools held the loop 1.1 s inline), and what the template
    writes around each message (250,000 empty messages held it 4 s inline: the template's loop, then 1.4 million
    ids of role markers). Their JSON is measured only where they are given: a plain chat pays a sum of lengths."""
    size = sum(len(m["content"]) for m in messages) + _MESSAGE_CHARS * len(messages)
    extras = [m for m in messages if len(m) > 2] if size < OFFLOAD_MIN_CHARS else []  # role and content alone: none
    if tools or kwargs or extras:
        try:
            size += len(orjson.dumps([tools, kwargs, extras]))
        except (TypeError, orjson.JSONEncodeError):  # past orjson's ints or depth: count it as large
            size += OFFLOAD_MIN_CHARS
    return size
