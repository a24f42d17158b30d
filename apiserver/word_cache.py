"""Byte-level BPE of plain ASCII text, word by word, each word's token ids cached.

Why: `tokenizers.Tokenizer.encode` of a unique 128-word prompt takes ~250 us here, half of it in its
pre-tokenizer's regex (onig). An API server tokenizes every new prompt on its event loop, so a wave of 256 new
requests held the loop for ~70 ms before the last one reached the engine (their TTFT). This path does the
same split with Python's `re` and looks each word up: ~30 us for the same prompt (`bench/tokenizing.py`).

Why it gives the same ids: a byte-level BPE tokenizer (GPT-2, SmolLM2, Llama 3, Qwen 2, ...) splits the text
with one regex into words, maps each word's bytes to characters and runs BPE on each word alone. On text of
printable ASCII, tab, newline and carriage return, the regex's Unicode classes (\\p{L}, \\p{N}, \\s) are exactly
their ASCII sets, so Python's `re` in ASCII mode splits the same way, and a word's ids depend on the word alone.
Any other text, or a tokenizer of another kind, goes to the Rust tokenizer as before. Tests compare the ids
with the tokenizer's on random text for each supported kind of pre-tokenizer.

Splitting at added tokens (`<|im_start|>`) happens before this (renderer._SegmentCache): text given here is
one piece between them.
"""
from __future__ import annotations

import json
import re

# tokenizers' ByteLevel pre-tokenizer's own regex (use_regex=true), GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The Unicode classes a split regex may use, as the ASCII characters they hold.
_ASCII_CLASSES = {
    "L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "",
    "N": "0-9", "Nd": "0-9", "Nl": "", "No": "", "M": "", "Mn": "", "Mc": "", "Me": "",
}
# Anything but printable ASCII, tab, newline and carriage return: such text goes to the Rust tokenizer.
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")
# Normalizers that leave such text as it is.
_IDENTITY_ON_ASCII = {"NFC", "NFD", "NFKC", "NFKD"}
# Bounded in the token ids it holds (one per word for most words): room for the whole vocabulary (a benchmark's
# random prompts draw words from all of it; real text repeats far fewer), within these bounds: ~5 MB at the
# least, ~20 MB at the most, also for words of many ids each. Full, it starts again empty, so a stream of unique
# words costs about what the tokenizer alone would, and never grows the RSS.
MIN_HELD_IDS = 32768
MAX_HELD_IDS = 131072
MAX_WORD_CHARS = 32


class WordCache:
    def __init__(self, tokenizer, ascii_pattern: str):
        """tokenizer: a `tokenizers.Tokenizer` of the kind `for_tokenizer` accepts; ascii_pattern: its split
        regex for Python's `re` (`_ascii_pattern`)."""
        self._model = tokenizer.model
        self._split = re.compile(ascii_pattern, re.ASCII).findall
        self._bytes_to_chars = str.maketrans(_byte_level_chars())
        self._ids: dict[str, tuple[int, ...]] = {}
        self._held_ids = 0
        self._max_held_ids = min(max(tokenizer.get_vocab_size(), MIN_HELD_IDS), MAX_HELD_IDS)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> WordCache | None:
        """A cache for `tokenizer` when it is byte-level BPE whose split this module can make; else None."""
        pattern = _split_pattern(json.loads(tokenizer.to_str()))
        ascii_pattern = _ascii_pattern(pattern) if pattern is not None else None
        return cls(tokenizer, ascii_pattern) if ascii_pattern is not None else None

    def encode(self, text: str) -> list[int] | None:
        """`text`'s ids as the tokenizer gives them (no added tokens inside, none added); None for text this
        path does not cover."""
        if _UNSAFE.search(text):
            return None
        words = self._split(text)
        if sum(map(len, words)) != len(text):  # a regex that leaves gaps: the tokenizer keeps them as words
            return None
        ids: list[int] = []
        cached = self._ids
        for word in words:
            word_ids = cached.get(word)
            if word_ids is None:
                word_ids = self._word_ids(word)
            ids.extend(word_ids)
        return ids

    def _word_ids(self, word: str) -> tuple[int, ...]:
        ids = tuple([token.id for token in self._model.tokenize(word.translate(self._bytes_to_chars))])
        if len(word) <= MAX_WORD_CHARS:
            if self._held_ids + len(ids) > self._max_held_ids:
                self._ids.clear()
                self._held_ids = 0
            self._ids[word] = ids
            self._held_ids += len(ids)
        return ids


def _split_pattern(spec: dict) -> str | None:
    """The split regex of a tokenizer.json's pipeline when this module reproduces it, else None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") not in _IDENTITY_ON_ASCII:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers") or ()) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or not isinstance(regex, str) or split.get("behavior") != "Isolated"
            or split.get("invert")):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    return regex


def _ascii_pattern(pattern: str) -> str | None:
    """`pattern` for Python's `re` on ASCII text: each \\p{X} as its ASCII characters; None when it uses what
    this cannot translate (\\P{X}, other classes, nested sets) or does not compile."""
    out: list[str] = []
    in_set = False
    set_start = 0  # index in `out` where the open set's content begins
    set_first = 0  # index in `pattern` of the open set's first character (a "]" there is literal)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            match = re.match(r"\\p\{(\w+)\}", pattern[i:])
            if match:
                chars = _ASCII_CLASSES.get(match.group(1))
                if chars is None:
                    return None
                out.append(chars if in_set else (f"[{chars}]" if chars else "(?!)"))
                i += match.end()
                continue
            if pattern[i + 1:i + 2] in ("P", "X", "R", "K", "h", "H", "G", "y", "Y", "O"):
                return None  # onig escapes Python lacks, or has with another meaning
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":
            if in_set:
                return None  # a nested set: onig's set operations
            in_set = True
            out.append("[^" if pattern[i + 1:i + 2] == "^" else "[")
            i += len(out[-1])
            set_start, set_first = len(out), i
            continue
        if c == "]" and in_set and i == set_first:
            out.append(r"\]")
            i += 1
            continue
        if c in "^$" and not in_set:
            return None  # onig's ^ and $ are line anchors, Python's are not
        if c == "]" and in_set:
            in_set = False
            if not "".join(out[set_start:]):  # every class in it was empty in ASCII
                negated = out[set_start - 1] == "[^"
                del out[set_start - 1:]
                out.append(r"[\s\S]" if negated else "(?!)")
            else:
                out.append(c)
            i += 1
            continue
        out.append(c)
        i += 1
    if in_set:
        return None
    translated = "".join(out)
    try:
        re.compile(translated, re.ASCII)
    except re.error:
        return None
    return translated


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map (tokenizers' ByteLevel), for the ASCII bytes: printable ones stand for
    themselves, the others (space, tab, newline, ...) for the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {byte: char for byte, char in chars.items() if byte < 128}
