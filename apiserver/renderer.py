"""From a request to prompt token ids: the model's chat template, then the tokenizer.

Both without transformers (apiserver.hf_tokenizer, apiserver.chat_template say why and how). The hot paths
(encode, decode, detokenize) use the Rust `tokenizers.Tokenizer` directly.
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict

import jinja2

from apiserver import long_text
from apiserver.chat_template import render_chat, template_variables
from apiserver.errors import InvalidRequest
from apiserver.hf_tokenizer import HFTokenizer
from apiserver.word_cache import WordCache

log = logging.getLogger(__name__)

# Arguments of apply_chat_template that chat_template_kwargs must not override.
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})
# Bounded in entries, in piece length and in what all the entries hold (characters plus token ids), so a stream of
# huge unique prompts cannot grow the RSS: 512 pieces of 8,000 emoji (24,000 ids each) held some 120 MB, where
# _SEGMENT_CACHE_HELD allows about 6 MB (pieces that repeat, a system prompt, role names, are far smaller).
_SEGMENT_CACHE_SIZE = 512
_SEGMENT_MAX_CHARS = 8192
_SEGMENT_CACHE_HELD = 2**20


def load_tokenizer(model_dir: str) -> HFTokenizer:
    return HFTokenizer(model_dir)


class Renderer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None = None, word_cache: bool = True):
        """chat_template: the template to use instead of the model's (--chat-template); word_cache: tokenize plain
        ASCII text with the word cache where it can (--no-tokenizer-word-cache: never)."""
        self.hf_tokenizer = tokenizer
        self.tokenizer = tokenizer.backend  # tokenizers.Tokenizer: Rust, no Python per-token work
        self._token_strings: list[str | None] | None = None  # by id, once /tokenize asks (token_strings)
        self.chat_template = chat_template or tokenizer.chat_template()
        self._segments = _SegmentCache(self.tokenizer, word_cache)
        self._affixes = _post_processor_affixes(self.tokenizer)
        self._cuttable = long_text.cuttable(self.tokenizer)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name` (so a request setting it changes the prompt)."""
        return bool(self.chat_template) and name in template_variables(self.chat_template)

    @property
    def tokenizing(self) -> str:
        """How this renderer turns text into ids, for the log."""
        words = self._segments.words
        if words is None:
            return "the Rust tokenizer for all text"
        return f"a word cache for {'plain and mostly-' if words.cuts_other_text else 'plain '}ASCII text, else the Rust tokenizer"

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt's token ids for `messages` (and the `tools` they may call), as the chat template writes them."""
        return self._segments.encode(
            self.chat_text(messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        )

    def chat_text(self, messages, add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None,
                  tools=None) -> str:
        if not self.chat_template:
            raise InvalidRequest("This model has no chat template: use /v1/completions.")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "`continue_final_message` and `add_generation_prompt` cannot both be true.", param="continue_final_message"
            )
        kwargs = chat_template_kwargs or {}
        reserved = _RESERVED_TEMPLATE_ARGS.intersection(kwargs)
        if reserved:
            name = sorted(reserved)[0]
            raise InvalidRequest(f"`chat_template_kwargs` may not set `{name}`.", param="chat_template_kwargs")
        try:
            # The request's kwargs override the special tokens' variables, as in transformers.
            variables = {**self.hf_tokenizer.special_tokens, **kwargs}
            return render_chat(self.chat_template, messages, variables, add_generation_prompt, continue_final_message,
                               tools)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            # The template refused the conversation (roles out of order, an empty final message, ...).
            raise InvalidRequest(f"The chat template cannot render these messages: {exc}", param="messages") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self._segments.encode(text)
        if self._affixes is None:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        prefix, suffix = self._affixes
        return prefix + self._segments.encode(text) + suffix

    def encode_long(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """What `encode` gives each text, by the Rust tokenizer in bounded batches, long texts in pieces where
        that is exact (apiserver.long_text): for texts too long for the word cache's per-word Python, in a
        worker thread (`encode_batch_fast` lets go of the GIL)."""
        split = self._segments.split if self._cuttable else None
        return long_text.encode(self.tokenizer, texts, split, add_special_tokens, self._affixes)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, release_gil: bool = False) -> str:
        return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, release_gil=release_gil)

    def token_strings(self, token_ids: list[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (`Ġthe`: transformers' convert_ids_to_tokens); None for an
        id the tokenizer has no token for. The table is made on first use: a lookup per id costs the Rust call's
        crossing, a list index does not."""
        if self._token_strings is None:
            table: list[str | None] = [None] * self.tokenizer.get_vocab_size(with_added_tokens=True)
            for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
                if i < len(table):
                    table[i] = token
            self._token_strings = table
        table = self._token_strings
        return [table[i] if i < len(table) else None for i in token_ids]


class _SegmentCache:
    """Encodes text without special tokens added, caching the pieces between added tokens.

    The tokenizer itself first splits text at its added tokens (`<|im_start|>`...) and encodes the pieces in
    between independently, so the same split here gives the same ids, and the pieces that repeat in every
    chat prompt (the default system prompt, role names) are tokenized once. Used only when every added token
    is matched literally (no lstrip/rstrip/single_word/normalized rules, special tokens not split), where the
    split is exact. The pieces themselves go through the word cache where it covers them (apiserver.word_cache).
    """

    def __init__(self, tokenizer, word_cache: bool = True):
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        # With split_special_tokens the special ones are encoded as text: no literal split then.
        self._literal = not tokenizer.encode_special_tokens and all(
            not (t.lstrip or t.rstrip or t.single_word or (t.normalized and not t.special)) for t in added.values()
        )
        self._added_ids = {t.content: i for i, t in added.items()}
        self._pattern = None
        if self._literal and self._added_ids:
            import re

            alternatives = sorted(self._added_ids, key=len, reverse=True)
            self._pattern = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._held = 0  # characters and token ids of the cached pieces, bounded by _SEGMENT_CACHE_HELD
        self.words = WordCache.for_tokenizer(tokenizer) if self._literal and word_cache else None

    def split(self, text: str) -> list[str | int]:
        """The text between the added tokens and the added tokens' ids, in order (the text itself where this
        cannot split); empty text between them left out."""
        if self._pattern is None:
            return [text]
        added_ids = self._added_ids
        return [added_ids[piece] if i % 2 else piece for i, piece in enumerate(self._pattern.split(text)) if piece]

    def encode(self, text: str) -> list[int]:
        if self._pattern is None:  # no added tokens, or ones this cannot split at: the text is one piece
            return self._piece_ids(text)
        ids: list[int] = []
        added_ids = self._added_ids
        cache = self._cache
        for i, piece in enumerate(self._pattern.split(text)):
            if i % 2:  # odd pieces are the added tokens the split matched
                ids.append(added_ids[piece])
            elif piece:
                cached = cache.get(piece)
                if cached is not None:
                    cache.move_to_end(piece)
                    ids.extend(cached)
                    continue
                piece_ids = self._piece_ids(piece)
                ids.extend(piece_ids)
                if len(piece) <= _SEGMENT_MAX_CHARS:
                    self._keep(piece, piece_ids)
        return ids

    def _keep(self, piece: str, piece_ids: list[int]) -> None:
        """Cache `piece`'s ids, then drop the least recently used pieces while the cache is past its bounds."""
        cache = self._cache
        cache[piece] = array("i", piece_ids)
        self._held += len(piece) + len(piece_ids)
        while len(cache) > _SEGMENT_CACHE_SIZE or self._held > _SEGMENT_CACHE_HELD:
            old, old_ids = cache.popitem(last=False)
            self._held -= len(old) + len(old_ids)

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self.words.encode(piece) if self.words is not None else None
        return ids if ids is not None else self._tokenizer.encode(piece, add_special_tokens=False).ids


def _post_processor_affixes(tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text's own (BOS, EOS), when that is all
    it does to them (so `encode` with special tokens is these around the ids without); else None."""
    affixes = set()
    for probe in ("a", "Hello, world 12!\n"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        starts = [s for s in range(len(full) - len(plain) + 1) if full[s:s + len(plain)] == plain]
        if not starts:
            return None
        affixes.add((tuple(full[:starts[0]]), tuple(full[starts[0] + len(plain):])))
    if len(affixes) != 1:
        return None
    prefix, suffix = affixes.pop()
    return list(prefix), list(suffix)
