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
# Llama 3's and OpenAI's cl100k; Qwen 2's; OpenAI's o200k.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Split regexes under which a space right after a printable ASCII character always begins a word: no
# alternative matches such a character followed by a space, none looks behind, and together they match every
# character. Text with other characters can then be cut before such spaces and its parts encoded apart: the
# plain ASCII parts here, the others by the tokenizer.
_CUTTABLE = {GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, O200K_PATTERN}
_CUT = re.compile(r"(?<=[!-~]) ")
# The groups a split regex may open: plain, case-insensitive, lookarounds, atomic.
_GROUP_PREFIX = re.compile(r"\(\?(?::|i:|=|!|<=|<!|>)")
# The Unicode classes a split regex may use, as the ASCII characters they hold.
_ASCII_CLASSES = {
    "L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "",
    "N": "0-9", "Nd": "0-9", "Nl": "", "No": "", "M": "", "Mn": "", "Mc": "", "Me": "",
}
# Anything but printable ASCII, tab, newline and carriage return: such text goes to the Rust tokenizer.
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")
_UNSAFE_RUN = re.compile(r"[^\t\n\r\x20-\x7e]+")
# Text with more runs of such characters than one per CHARS_PER_MIXED_RUN characters (and MAX_MIXED_RUNS in
# all, for short text) is not mostly ASCII: it goes to the tokenizer whole, as each run costs a tokenizer call
# (~4 us) that the words around it would not cost in one call.
MAX_MIXED_RUNS = 16
CHARS_PER_MIXED_RUN = 48
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
    def __init__(self, tokenizer, ascii_pattern: str, cuttable: bool = False):
        """tokenizer: a `tokenizers.Tokenizer` of the kind `for_tokenizer` accepts; ascii_pattern: its split
        regex for Python's `re` (`_ascii_pattern`); cuttable: text with other characters may be cut (_CUTTABLE)."""
        self._tokenizer = tokenizer
        self._model = tokenizer.model
        self._cuttable = cuttable
        self._split = re.compile(ascii_pattern, re.ASCII).findall
        self._bytes_to_chars = str.maketrans(_byte_level_chars())
        self._ids: dict[str, tuple[int, ...]] = {}
        self._held_ids = 0
        self._max_held_ids = min(max(tokenizer.get_vocab_size(), MIN_HELD_IDS), MAX_HELD_IDS)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> WordCache | None:
        """A cache for `tokenizer` when it is byte-level BPE whose split this module can make; else None."""
        spec = json.loads(tokenizer.to_str())
        pattern = _split_pattern(spec)
        ascii_pattern = _ascii_pattern(pattern) if pattern is not None else None
        if ascii_pattern is None:
            return None
        # NFC never joins characters across a space; NFKC and the decompositions may change text at a cut.
        cuttable = pattern in _CUTTABLE and (spec.get("normalizer") or {}).get("type", "NFC") == "NFC"
        return cls(tokenizer, ascii_pattern, cuttable)

    def encode(self, text: str) -> list[int] | None:
        """`text`'s ids as the tokenizer gives them (no added tokens inside, none added); None for text this
        path does not cover."""
        if not _UNSAFE.search(text):
            return self._ascii_ids(text)
        return self._mixed_ids(text) if self._cuttable else None

    def _mixed_ids(self, text: str) -> list[int] | None:
        """Text with a few runs of other characters: each run with the text around it up to the nearest cuts
        (spaces after a printable ASCII character) by the tokenizer, the plain ASCII between them here."""
        runs: list[tuple[int, int]] = []
        most = max(MAX_MIXED_RUNS, len(text) // CHARS_PER_MIXED_RUN)
        for match in _UNSAFE_RUN.finditer(text):
            if len(runs) == most:
                return None
            runs.append(match.span())
        ids: list[int] = []
        done = 0  # text[:done] is encoded: 0 or a cut
        for start, end in runs:
            if end <= done:  # in the part the run before took
                continue
            low = _cut_before(text, start, done)
            after = _CUT.search(text, end)
            high = after.start() if after else len(text)
            if low > done:
                ids += self._part_ids(text[done:low])
            ids += self._tokenizer.encode(text[low:high], add_special_tokens=False).ids
            done = high
        if done < len(text):
            ids += self._part_ids(text[done:])
        return ids

    def _part_ids(self, part: str) -> list[int]:
        ids = self._ascii_ids(part)
        return ids if ids is not None else self._tokenizer.encode(part, add_special_tokens=False).ids

    def _ascii_ids(self, text: str) -> list[int] | None:
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


def _cut_before(text: str, at: int, done: int) -> int:
    """The last cut in text[done:at], else `done`."""
    space = text.rfind(" ", done, at)
    while space > done and not "!" <= text[space - 1] <= "~":
        space = text.rfind(" ", done, space)
    return max(space, done)


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
            if pattern[i + 1:i + 2] in ("P", "X", "R", "K", "h", "H", "G", "y", "Y", "O", "Z"):
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
        if c == "(" and not in_set and pattern[i + 1:i + 2] == "?" and not _GROUP_PREFIX.match(pattern, i):
            return None  # inline flags: onig's (?m) is Python's (?s), and Python takes global ones only first
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
