"""Log-probabilities in each API's own format, from the engine's per-token
`(token id, [sampled logprob, [[token id, logprob], ...top]])` entries. With echo, completions put the prompt's
entries first; the first prompt token's is `(token id, None)` (nothing before it predicts it): null logprobs.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`: exactly the N
likeliest tokens (OpenAI's rule for chat), whether or not the sampled one is among them.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`: each
`top_logprobs` entry holds the sampled (or echoed) token first, then the N likeliest, so N+1 entries when the
token is not among them (OpenAI's legacy format allows it, vLLM does it, and clients look their own token up).

A token of a byte-level BPE tokenizer may hold part of a character (an emoji is often three): its `token` text is
U+FFFD, as in vLLM, but chat's `bytes` are the token's own, so joining a reply's `bytes` gives its UTF-8 (what
OpenAI documents them for), and completions' `text_offset` counts the characters the tokens before it completed.
"""
from __future__ import annotations

import codecs

from apiserver.byte_stream import byte_tables


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        tables = byte_tables(tokenizer)
        self._token_bytes = tables.keeping if tables is not None else None
        self._text_of: dict[int, str] = {}
        self._bytes_of: dict[int, list[int]] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text_of.get(token_id)
        if text is None:
            # Decoded alone (a byte-level fragment of a character decodes to U+FFFD, as in vLLM).
            text = self._text_of[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes where the tokenizer is byte-level BPE (a fragment of a character too); else its
        text's UTF-8."""
        table = self._token_bytes
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        return self.token_text(token_id).encode()

    def token_bytes(self, token_id: int) -> list[int]:
        data = self._bytes_of.get(token_id)
        if data is None:
            data = self._bytes_of[token_id] = list(self.raw_bytes(token_id))
        return data

    @property
    def byte_level(self) -> bool:
        return self._token_bytes is not None

    def offsets(self) -> TextOffsets:
        return TextOffsets(self)

    def chat(self, entries: list, top_n: int) -> list[dict]:
        content = []
        for token_id, (logprob, top) in entries:
            text = self.token_text(token_id)
            content.append({
                "token": text,
                "logprob": _finite(logprob),
                "bytes": self.token_bytes(token_id),
                "top_logprobs": [
                    {"token": self.token_text(i), "logprob": _finite(lp), "bytes": self.token_bytes(i)}
                    for i, lp in top[:top_n]
                ],
            })
        return content

    def completion(self, entries: list, top_n: int, text_offsets: TextOffsets) -> dict:
        """`text_offsets`: the choice's, carried from its entries before these (a stream's earlier events)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, data in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            if data is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                logprob, top = data
                token_logprobs.append(_finite(logprob))
                tops = {text: _finite(logprob)}
                for i, lp in top[:top_n]:
                    tops.setdefault(self.token_text(i), _finite(lp))
                top_logprobs.append(tops)
            offsets.append(text_offsets.advance(token_id))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters: the characters the tokens before it
    completed (their bytes decoded as one UTF-8 stream, invalid bytes as U+FFFD), so the tokens of one emoji
    start where it does and the next token after it."""

    def __init__(self, formatter: LogprobFormatter):
        self._formatter = formatter
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace") if formatter.byte_level else None
        self._offset = 0

    def advance(self, token_id: int) -> int:
        """The offset of `token_id`'s text, the next token's after it."""
        start = self._offset
        if self._decoder is None:
            self._offset += len(self._formatter.token_text(token_id))
        else:
            self._offset += len(self._decoder.decode(self._formatter.raw_bytes(token_id)))
        return start


def _finite(logprob: float | None) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what vLLM sends for the same case. The engine's
    # -inf (a token a structured output's mask bars) reaches us as null: orjson writes -inf so.
    return logprob if logprob is not None and logprob > -9999.0 else -9999.0
