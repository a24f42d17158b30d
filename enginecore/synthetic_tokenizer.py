"""A deterministic tokenizer that covers a model's whole vocabulary, for `--load-format dummy` when the model
directory holds only a config.json (bench/models/llama-3.1-8b): the API servers need a tokenizer, and the hub
cannot be reached. Built with the `tokenizers` library from the config alone, so the same config always gives
the same tokenizer.

Byte-level BPE, as Llama 3 and GPT-2 use: ids 0-255 are the bytes, then lowercase pseudo-words grown one
letter at a time by merges (" a", " ab", " abc", " abcd", ..., and the same without the leading space), so
text encodes at a few characters per token and random ids decode to readable words. The last 256 ids are
special tokens named as in Llama 3 (`<|begin_of_text|>`, `<|end_of_text|>`, `<|start_header_id|>`,
`<|eot_id|>`, `<|reserved_special_token_N|>`, ...); BOS, EOS and pad ids the config names elsewhere become
special tokens too. Encoding with special tokens adds BOS; the chat template is Llama 3's.
"""
from __future__ import annotations

import itertools
import string

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

VERSION = 1  # part of the cache key: bump when the tokenizer built from a config changes
MIN_VOCAB_SIZE = 1024
SPECIAL_REGION = 256  # Llama 3's 128256 = 128000 + 256
# Llama 3's special tokens by offset in the top region; the other offsets are its reserved tokens, numbered.
_LLAMA3_SPECIAL = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                   6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
                   10: "<|python_tag|>"}
CHAT_TEMPLATE = (  # Meta-Llama-3-Instruct's
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (what ByteLevel pre-tokenization produces)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


_BYTES = _byte_chars()
_SPACE = _BYTES[ord(" ")]  # "Ġ"


def _base_tokens():
    """(token, merge or None): the bytes, then words each one letter longer than a token before it."""
    for char in _BYTES:
        yield char, None
    letters = string.ascii_lowercase
    for x in letters:
        yield _SPACE + x, (_SPACE, x)
    for length in (2, 3, 4):
        for combo in itertools.product(letters, repeat=length):
            word = "".join(combo)
            yield _SPACE + word, (_SPACE + word[:-1], word[-1])
            if length < 4:
                yield word, (word[:-1], word[-1])


def special_tokens(vocab_size: int, named_ids: list[int]) -> dict[int, str]:
    """Id -> name: the top 256 ids as Llama 3 names them, and the ids the config names wherever they are."""
    first = vocab_size - SPECIAL_REGION
    names, reserved = {}, itertools.count()
    for offset in range(SPECIAL_REGION):
        names[first + offset] = _LLAMA3_SPECIAL.get(offset) or f"<|reserved_special_token_{next(reserved)}|>"
    for i in named_ids:
        names.setdefault(i, f"<|special_{i}|>")
    return names


def build(vocab_size: int, bos_id: int | None, eos_ids: list[int], pad_id: int | None) -> tuple[Tokenizer, dict]:
    """The tokenizer and its tokenizer_config.json for a vocabulary of exactly `vocab_size` ids."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a synthetic tokenizer needs a vocabulary of at least {MIN_VOCAB_SIZE} ids, not {vocab_size}")
    named = [i for i in (bos_id, *eos_ids, pad_id) if i is not None and 0 <= i < vocab_size]
    specials = special_tokens(vocab_size, named)
    vocab, merges = {}, []
    base = _base_tokens()
    for token_id in range(vocab_size):
        if token_id in specials:
            token = specials[token_id]
        else:
            token, merge = next(base)
            if merge is not None:
                merges.append(merge)
        vocab[token] = token_id
    # Merges with the leading space rank first, so a space-led word always grows from its left end into one token.
    merges.sort(key=lambda merge: not merge[0].startswith(_SPACE))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))  # no unknown token: every byte has an id
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False}
    if bos_id in specials:
        bos = specials[bos_id]
        config["bos_token"] = bos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    if eos_ids and eos_ids[0] in specials:
        config["eos_token"] = specials[eos_ids[0]]
    if pad_id in specials:
        config["pad_token"] = specials[pad_id]
    return tokenizer, config
