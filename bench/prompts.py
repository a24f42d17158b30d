"""Random prompts of an exact token length, for load that neither a prefix cache nor a repeated text helps.

With the embedded model's tokenizer (or `--tokenizer DIR`): a prompt is N words drawn from the vocabulary's
own space-prefixed lowercase words, each exactly one token, so the prompt is exactly N tokens (the chat
template adds its own few). Without a tokenizer: words from a small built-in list, about one token each.
A DIR with only a config.json (bench/models/llama-3.1-8b) gets the synthetic tokenizer that
`supervise --load-format dummy` serves it with.
"""
from __future__ import annotations

import os
import random
import re

_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


def embedded_tokenizer_dir() -> str | None:
    """The converted embedded model's directory, when `make setup` made it; None elsewhere."""
    try:
        from enginecore.model_source import resolve_model

        return resolve_model(None)
    except Exception:  # not installed, or a machine without the embedded model: fall back to words
        return None


class RandomPrompts:
    def __init__(self, tokenizer_dir: str | None = None, seed: int = 0):
        self.random = random.Random(seed)
        self.tokenizer = None
        self.words: list[str] = list(_FALLBACK_WORDS)
        self.first_words: list[str] = self.words
        if tokenizer_dir and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
            from enginecore.model_source import dummy_model_dir

            tokenizer_dir = dummy_model_dir(tokenizer_dir)
        path = os.path.join(tokenizer_dir, "tokenizer.json") if tokenizer_dir else None
        if path and os.path.isfile(path):
            from transformers import PreTrainedTokenizerFast

            self.tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
            vocab = self.tokenizer.get_vocab()
            # "Ġword" is " word" as one token; the first word has no space before it, so it must also encode
            # as one token on its own (being in the vocabulary is not enough: BPE may split it otherwise).
            self.words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and re.fullmatch(r"[a-z]{3,}", w[1:]))
            alone = [w for w in self.words if w in vocab]
            encoded = self.tokenizer(alone, add_special_tokens=False).input_ids if alone else []
            self.first_words = [w for w, ids in zip(alone, encoded) if len(ids) == 1]

    @property
    def source(self) -> str:
        return "tokenizer vocabulary" if self.tokenizer is not None else "built-in word list"

    def prompt(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        pick = self.random.choice
        return " ".join([pick(self.first_words)] + [pick(self.words) for _ in range(num_tokens - 1)])

    def count_tokens(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompts(self, count: int, num_tokens: int) -> list[str]:
        return [self.prompt(num_tokens) for _ in range(count)]
