"""Log-probabilities in each API's own format, from the engine's per-token
`(token id, [sampled logprob, [[token id, logprob], ...top]])` entries. With echo, completions put the prompt's
entries first; the first prompt token's is `(token id, None)` (nothing before it predicts it): null logprobs.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`: exactly the N
likeliest tokens (OpenAI's rule for chat), whether or not the sampled one is among them.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`: each
`top_logprobs` entry holds the sampled (or echoed) token first, then the N likeliest, so N+1 entries when the
token is not among them (OpenAI's legacy format allows it, vLLM does it, and clients look their own token up).
"""
from __future__ import annotations


class LogprobFormatter:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._text_of: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text_of.get(token_id)
        if text is None:
            # Decoded alone (a byte-level fragment of a character decodes to U+FFFD, as in vLLM).
            text = self._text_of[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def chat(self, entries: list, top_n: int) -> list[dict]:
        content = []
        for token_id, (logprob, top) in entries:
            text = self.token_text(token_id)
            content.append({
                "token": text,
                "logprob": _finite(logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(i)), "logprob": _finite(lp), "bytes": list(t.encode())}
                    for i, lp in top[:top_n]
                ],
            })
        return content

    def completion(self, entries: list, top_n: int, text_offset: int) -> dict:
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
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _finite(logprob: float | None) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what vLLM sends for the same case. The engine's
    # -inf (a token a structured output's mask bars) reaches us as null: orjson writes -inf so.
    return logprob if logprob is not None and logprob > -9999.0 else -9999.0
