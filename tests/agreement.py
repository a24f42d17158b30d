"""How closely a quantized engine follows the float32 one, on a fixed prompt set (shared by
tests/test_quantization.py and bench/quantization.py; no tests here).

Two measures, both what a user of a quantized model would check:
- greedy agreement: the float32 engine's greedy continuation of each prompt is fed to the other engine as
  prompt (teacher forcing, through prompt logprobs); the share of positions where the other engine's most
  likely token is float32's token. Free-running greedy text is also compared, position by position, but one
  early difference shifts everything after it, so that figure is printed, not bounded;
- loglikelihood: the mean per-token log-probability each engine gives those continuations (what
  lm-evaluation-harness's loglikelihood tasks compute), and the largest per-prompt difference of the means.
"""
from __future__ import annotations

from dataclasses import dataclass

from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List five prime numbers and say why each is prime.",
    "Give me three tips for learning to play the guitar.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
]


@dataclass
class Agreement:
    positions: int
    teacher_forced: float  # share of positions where the argmax equals float32's greedy token
    free_running: float  # share of positions where free-running greedy tokens are equal
    mean_logprob_reference: float
    mean_logprob_other: float
    max_prompt_logprob_gap: float  # largest |difference of mean per-token logprob| over the prompts


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = engine.generate([EngineRequest(f"g{i}", p, params) for i, p in enumerate(prompts)])
    return [out[(f"g{i}", 0)] for i in range(len(prompts))]


def scored(engine, prompts: list[list[int]], continuations: list[list[int]]) -> list[list]:
    """Per prompt, the prompt-logprob entries [logprob, [[top id, logprob]]] of its continuation's tokens."""
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)
    requests = [EngineRequest(f"s{i}", p + c, params) for i, (p, c) in enumerate(zip(prompts, continuations))]
    entries: dict[str, list] = {}
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        for _, out in engine.step():
            if out.prompt_logprobs is not None:
                entries[out.request_id] = out.prompt_logprobs
    # prompt_logprobs has an entry per prompt token but the first; the continuation's are the last len(c).
    return [entries[f"s{i}"][-len(c):] for i, c in enumerate(continuations)]


@dataclass
class Reference:
    prompts: list[list[int]]
    continuations: list[list[int]]  # the float32 engine's greedy tokens
    scores: list[list]  # its prompt-logprob entries of them


def reference(engine, prompts: list[list[int]], max_tokens: int = 32) -> Reference:
    continuations = greedy(engine, prompts, max_tokens)
    return Reference(prompts, continuations, scored(engine, prompts, continuations))


def agreement(ref: Reference, other_engine) -> Agreement:
    other = greedy(other_engine, ref.prompts, max(len(c) for c in ref.continuations))
    other_scores = scored(other_engine, ref.prompts, ref.continuations)
    positions = sum(len(c) for c in ref.continuations)
    forced = sum(entry[1][0][0] == token
                 for c, s in zip(ref.continuations, other_scores) for token, entry in zip(c, s))
    free = sum(a == b for r, o in zip(ref.continuations, other) for a, b in zip(r, o))
    ref_means = [sum(e[0] for e in s) / len(s) for s in ref.scores]
    other_means = [sum(e[0] for e in s) / len(s) for s in other_scores]
    return Agreement(
        positions=positions,
        teacher_forced=forced / positions,
        free_running=free / positions,
        mean_logprob_reference=sum(ref_means) / len(ref_means),
        mean_logprob_other=sum(other_means) / len(other_means),
        max_prompt_logprob_gap=max(abs(a - b) for a, b in zip(ref_means, other_means)),
    )
