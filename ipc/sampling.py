"""Per-request sampling parameters, as the API server sends them and the engine's sampler reads them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top k
    # None: none; k: each prompt token's logprob (from the second on) plus the top k at its position
    prompt_logprobs: int | None = None
    # Structured outputs: an llguidance grammar as JSON text (ipc/grammar.py); every token is masked by it.
    grammar: str | None = None
    # OpenAI's logit_bias: logit_bias_values[i] is added to the logit of token logit_bias_ids[i] before sampling
    # (after the structured-output mask; logprobs stay the raw distribution's). Two lists: JSON objects have only
    # string keys, and a list of ints is checked in C at decoding.
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        """Any penalty that reads the tokens generated so far."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
