"""Byte-level BPE of plain ASCII text, word by word, each word's token ids cached.

Why: `tokenizers.Tokenizer.encode` of a unique 128-word prompt takes ~250 us here, half of it in its
pre-tokenizer's regex (onig). An API server tokenizes every new prompt on its event loop, so a wave of 256 new
requests held the loop for ~90 ms before the last one reached the engine (their TTFT). This path does the
same split with Python's `re` and looks each word up: ~30 us for the same prompt (`bench/tokenizing.py`).

Why it gives the same ids: a byte-level BPE tokenizer (GPT-2, SmolLM2, Llama 3, Qwen 2, ...) splits the text
with one regex into words, maps each word's bytes to characters and runs BPE on each word alone. On text of
printable ASCII, tab, newline and carriage return, the regex's Unicode classes (\\p{L}, \\p{N}, \\s) are exactly
their ASCII sets, so Python's `re` in ASCII mode splits the same way (apiserver.split_regex), and a word's ids
depend on the word alone. Mostly-ASCII text is cut where the regex always begins a word (split_regex.CUT): the
parts with other characters go to the tokenizer, the rest through the cache. Text of mostly other characters,
or a tokenizer of another kind, goes to the Rust tokenizer as before. Tests compare the ids with the
tokenizer's on random text for each supported kind of pre-tokenizer.

Splitting at added tokens (`<|im_start|>`) happens before this (renderer._SegmentCache): text given here is
one piece between them.
"""
from __future__ import annotations

import json
import re

from apiserver import split_regex
from apiserver.byte_stream import byte_level_chars

# Anything but printable ASCII, tab, newline and carriage return: such text goes to the Rust tokenizer.
_UNSAFE = re.compile(r"[^\t\n\r\x20-\x7e]")
_UNSAFE_RUN = re.compile(r"[^\t\n\r\x20-\x7e]+")
# Text with more runs of such characters than one per CHARS_PER_MIXED_RUN characters (and MAX_MIXED_RUNS in
# all, for short text) is not mostly ASCII: it goes to the tokenizer whole, as each run costs a tokenizer call
# (~4 us) that the words around it would not cost in one call.
MAX_MIXED_RUNS = 16
CHARS_PER_MIXED_RUN = 48
# Bounded in the token ids it holds (one per word for most words): room for the whole vocabulary (a benchmark's
# random prompts draw words from all of it; real text repeats far fewer), within these bounds: ~5 MB at the
# least, ~20 MB at the most, also for words of many ids each. Full, it starts again empty, so a stream of unique
# words costs about what the tokenizer alone would, and never grows the RSS.
MIN_HELD_IDS = 32768
MAX_HELD_IDS = 131072
MAX_WORD_CHARS = 32


class WordCache:
    def __init__(self, tokenizer, ascii_pattern: str, cut_other_text: bool = False):
        """tokenizer: a `tokenizers.Tokenizer` of the kind `for_tokenizer` accepts; ascii_pattern: its split
        regex for Python's `re` (`split_regex.python_pattern`); cut_other_text: text with other characters may
        be cut (`split_regex.cuttable`)."""
        self._tokenizer = tokenizer
        self._model = tokenizer.model
        self.cuts_other_text = cut_other_text
        self._split = re.compile(ascii_pattern, re.ASCII).findall
        self._bytes_to_chars = str.maketrans({b: c for b, c in byte_level_chars().items() if b < 128})
        self._single: dict[str, int] = {}  # the words of one token
        self._multi: dict[str, tuple[int, ...]] = {}  # the others
        self._held_ids = 0
        self._max_held_ids = min(max(tokenizer.get_vocab_size(), MIN_HELD_IDS), MAX_HELD_IDS)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> WordCache | None:
        """A cache for `tokenizer` when it is byte-level BPE whose split this module can make; else None."""
        spec = json.loads(tokenizer.to_str())
        pattern = split_regex.split_pattern(spec)
        if pattern is None:
            return None
        ascii_pattern = split_regex.python_pattern(pattern)
        if ascii_pattern is None:
            return None
        return cls(tokenizer, ascii_pattern, split_regex.cuttable(spec, pattern))

    def encode(self, text: str) -> list[int] | None:
        """`text`'s ids as the tokenizer gives them (no added tokens inside, none added); None for text this
        path does not cover."""
        if not _UNSAFE.search(text):
            return self._ascii_ids(text)
        return self._mixed_ids(text) if self.cuts_other_text else None

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
            after = split_regex.CUT.search(text, end)
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
        # Most words are one token each: their ids come in one pass in C, and text of such words alone needs no
        # other (each word looked up is a few cache misses on a loaded server, so fewer objects per word pay).
        found = list(map(self._single.get, words))
        if None not in found:
            return found  # type: ignore[return-value]
        ids: list[int] = []
        single, multi = self._single, self._multi
        for word, token_id in zip(words, found):
            if token_id is None:
                token_id = single.get(word)  # met earlier in this text
            if token_id is not None:
                ids.append(token_id)
                continue
            word_ids = multi.get(word)
            ids.extend(word_ids if word_ids is not None else self._word_ids(word))
        return ids

    def _word_ids(self, word: str) -> tuple[int, ...]:
        ids = tuple([token.id for token in self._model.tokenize(word.translate(self._bytes_to_chars))])
        if len(word) <= MAX_WORD_CHARS:
            held = max(1, len(ids))  # a word of no ids (bytes a pruned vocabulary lacks) still takes room
            if self._held_ids + held > self._max_held_ids:
                self._single.clear()
                self._multi.clear()
                self._held_ids = 0
            if len(ids) == 1:
                self._single[word] = ids[0]
            else:
                self._multi[word] = ids
            self._held_ids += held
        return ids


def _cut_before(text: str, at: int, done: int) -> int:
    """The last cut in text[done:at], else `done`: split_regex.CUT searched backwards."""
    space = text.rfind(" ", done, at)
    while space > done and not "!" <= text[space - 1] <= "~":
        space = text.rfind(" ", done, space)
    return max(space, done)
