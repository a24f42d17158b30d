"""Incremental detokenization of one output sequence, with stop strings matched on the text.

Token ids arrive a few at a time; text must come out as soon as it is certain. tokenizers' DecodeStream does
the hard part in Rust: it holds back bytes until they form whole UTF-8 characters (a 4-byte emoji spread over
three byte-level tokens), and decodes each token in the context of the ones before, so SentencePiece's `▁`
and byte-level `Ġ` become the right spaces. Seeding it with the end of the prompt makes the first generated
token decode as it would mid-text (SentencePiece would otherwise drop its leading space). For a byte-level BPE
tokenizer the same comes from a table of each token's bytes (apiserver/byte_stream.py), at a fraction of the
cost per token.

Stop strings are matched here, on the text, because a stop string can span tokens. Text that might be the
beginning of a stop string is held back until it is clear, so a stop string never leaks into the output. A
token's new text is searched only for the stop strings whose last character it holds (apiserver/stop_strings.py).
Under `min_tokens` the first tokens' text is not searched (vLLM's rule): a stop string can end the text only from
the token after the min_tokens-th on, as an EOS or a stop token id can only end it there in the engine.
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from apiserver.byte_stream import ByteLevelStream, byte_tables, unfinished_character
from apiserver.stop_strings import NO_STOP_STRINGS, StopStrings

# How much of the prompt primes the decoder: enough for the context a token's decoding depends on.
PROMPT_CONTEXT_TOKENS = 4


def generated_text_completes_the_prompt(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> bool:
    """Whether the prompt's text ends inside a character, which the generated text then begins with whole (its
    first bytes are the prompt's: the decoder holds them as its context). Where so, an echoed prompt must end
    before that character, or it would be in the answer twice (once as U+FFFD). Known for byte-level tokenizers;
    False for the others."""
    tables = byte_tables(tokenizer)
    return tables is not None and bool(unfinished_character(tables.of(False),
                                                            prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_stream", "_stops", "_hold", "_include_stop", "_unsent", "_unchecked", "stop_reason")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: StopStrings = NO_STOP_STRINGS,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if prompt_token_ids else None
        tables = byte_tables(tokenizer)
        self._stream = (ByteLevelStream(tables.of(skip_special_tokens), context) if tables is not None
                        else DecodeStream(ids=context, skip_special_tokens=skip_special_tokens))
        self._stops = stop if stop else None  # (None: no set test per token)
        self._hold = stop.hold
        self._include_stop = include_stop_str_in_output
        # Only the text not handed out yet is kept: appending to the whole text would copy it all on every
        # token. A stop string cannot begin in text already handed out, because the last `_hold` characters
        # are always held back.
        self._unsent = ""
        self._unchecked = min_tokens if stop else 0  # tokens still to come whose text no stop string may end in
        self.stop_reason: str | None = None  # the stop string that ended the text

    def add_tokens(self, token_ids: list[int]) -> int:
        """Decode `token_ids` onto the text; returns how many were used: fewer than all when a stop string
        ended the text (then `stop_reason` is set and later tokens are to be ignored)."""
        if self._unchecked:
            return self._add_unchecked(token_ids)
        step = self._stream.step
        tokenizer = self._tokenizer
        stops = self._stops
        for used, token_id in enumerate(token_ids, 1):
            piece = step(tokenizer, token_id)
            if piece:
                start = len(self._unsent)
                self._unsent += piece
                if stops is not None and self._find_stop(stops, start):
                    return used
        return len(token_ids)

    def _add_unchecked(self, token_ids: list[int]) -> int:
        """add_tokens while the first min_tokens tokens come: their text is not searched for stop strings."""
        unchecked = token_ids[:self._unchecked]
        self._unchecked -= len(unchecked)
        for token_id in unchecked:
            self._unsent += self._stream.step(self._tokenizer, token_id) or ""
        rest = token_ids[len(unchecked):]
        return len(unchecked) + (self.add_tokens(rest) if rest else 0)

    def _find_stop(self, stops: StopStrings, new_text_start: int) -> bool:
        text = self._unsent
        match = stops.first_in(text, new_text_start)
        if match is None:
            return False
        found_at, found = match
        self._unsent = text[: found_at + len(found)] if self._include_stop else text[:found_at]
        self.stop_reason = found
        return True

    def take_delta(self, final: bool = False) -> str:
        """The text not handed out yet, minus what might still turn into a stop string unless `final`."""
        unsent = self._unsent
        end = len(unsent)
        if not final and self._hold and self.stop_reason is None:
            end -= self._hold
        if end <= 0:
            return ""
        self._unsent = unsent[end:]
        return unsent[:end]
