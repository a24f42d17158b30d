"""Incremental decoding for byte-level BPE tokenizers in Python: what tokenizers' DecodeStream gives, for a table
lookup per token instead of a call into Rust that decodes its window again.

Under GPT-2's ByteLevel decoder (Llama 3, Qwen 2, SmolLM2, GPT-2's own family) a token's text is its bytes: the
characters of the token's string mapped back through GPT-2's byte-to-character table (an added token's content as
it is), read as UTF-8. DecodeStream decodes a window of recent tokens on every step and gives out the new text
once that text does not end in U+FFFD (a character still incomplete). With bytes that is: keep the bytes not given
out yet; after each token, read them as UTF-8 (invalid bytes as U+FFFD, as Rust's from_utf8_lossy reads them);
give the text out when there is some and it does not end in U+FFFD. A paced streamed token then costs the API
server about 8% less CPU (bench/paced_pair.py side by side; README, Performance).

The table is made only for a tokenizer whose decoder is ByteLevel alone, and only if the tokenizer's own decode of
every single token whose bytes are whole UTF-8 gives the same text (added and special tokens included, with and
without skipping special tokens); otherwise DecodeStream does all the decoding, as before. A test compares both
step by step on random token sequences: byte fragments, multi-byte characters, special and unknown ids.
"""
from __future__ import annotations

import codecs
import logging
from functools import lru_cache

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class ByteTables:
    """Each token id's bytes, without special tokens and with them; ids past the vocabulary have none."""

    __slots__ = ("skipping", "keeping")

    def __init__(self, skipping: list[bytes], keeping: list[bytes]):
        self.skipping = skipping
        self.keeping = keeping

    def of(self, skip_special_tokens: bool) -> list[bytes]:
        return self.skipping if skip_special_tokens else self.keeping


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map (tokenizers' ByteLevel): printable bytes stand for themselves, the others
    (space, control bytes, ...) for the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return chars


def _token_bytes(token: str, char_bytes: dict[str, int]) -> bytes:
    try:
        return bytes(char_bytes[c] for c in token)
    except KeyError:  # a character outside the map: ByteLevel takes the whole token's own UTF-8
        return token.encode()


@lru_cache(maxsize=8)
def byte_tables(tokenizer) -> ByteTables | None:
    """The tables for this `tokenizers.Tokenizer`, or None where its decoding is not ByteLevel's alone (or
    does not check out)."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    char_bytes = {char: byte for byte, char in byte_level_chars().items()}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    keeping: list[bytes] = []
    for token_id in range(size):
        if token_id in added:
            keeping.append(added[token_id].content.encode())
        else:
            token = tokenizer.id_to_token(token_id)
            keeping.append(b"" if token is None else _token_bytes(token, char_bytes))
    special = {token_id for token_id, token in added.items() if token.special}
    skipping = [b"" if token_id in special else data for token_id, data in enumerate(keeping)]
    for skip, table in ((True, skipping), (False, keeping)):
        decoded = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=skip)
        for token_id, (data, text) in enumerate(zip(table, decoded)):
            try:
                expected = data.decode()
            except UnicodeDecodeError:
                continue  # a byte fragment: its text shows only with the tokens around it
            if text != expected:
                log.info("detokenizing: DecodeStream (token %d decodes to %r, its bytes say %r)", token_id, text,
                         expected)
                return None
    return ByteTables(skipping, keeping)


class ByteLevelStream:
    """DecodeStream's `step` for a byte-level tokenizer, from its table (ByteTables.of)."""

    __slots__ = ("_table", "_size", "_pending")

    def __init__(self, table: list[bytes], context: list[int] | None = None):
        """`context`: the end of the prompt. Its bytes matter only where they end inside a character: the first
        tokens generated complete it, and the whole character is their text."""
        self._table = table
        self._size = len(table)
        self._pending = unfinished_character(table, context or [])

    def step(self, tokenizer, token_id: int) -> str | None:
        """The text this token completes, or None while there is none yet (`tokenizer`: DecodeStream's
        signature; unused)."""
        pending = self._pending + (self._table[token_id] if 0 <= token_id < self._size else b"")
        text = pending.decode("utf-8", "replace")
        if not text or text[-1] == REPLACEMENT:
            self._pending = pending
            return None
        self._pending = b""
        return text


def unfinished_character(table: list[bytes], token_ids: list[int]) -> bytes:
    """The bytes at the end of these tokens' text that begin a character and do not finish it (b"" if none)."""
    size = len(table)
    data = b"".join(table[i] for i in token_ids if 0 <= i < size)
    # (Most prompts end in ASCII, a chat's always: nothing incomplete, no decoder to make.)
    return _incomplete_tail(data) if data and data[-1] >= 0x80 else b""


def _incomplete_tail(data: bytes) -> bytes:
    """The bytes at the end of `data` that begin a character and do not finish it (b"" if none): what a UTF-8
    decoder keeps back, waiting for more."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return decoder.getstate()[0]
