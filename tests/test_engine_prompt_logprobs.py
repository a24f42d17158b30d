"""Prompt logprobs (what echo + logprobs on /v1/completions needs): each prompt token's logprob from the second on,
with the top N at its position, equal to plain transformers' log_softmax over one forward pass of the prompt,
however the prompt is chunked, cached or preempted, and sent exactly once."""
import functools

import pytest
import torch

from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams
from tests.test_engine_support import (  # noqa: F401
    engine_block_bytes, loaded_model, make_engine, prompts, record_preemptions, reference_greedy, run_outputs,
)

TOP = 3
# float32 against float32, in another summation order: the engine's CPU forward fuses its products (q/k/v, gate/up,
# the residual inside addmm) in the weight layout timed fastest at start-up, and runs a chunked prompt in small
# batches. Column-major weights with 7-token chunks measured 1.2e-4 nats off transformers' forward (row-major:
# 4e-5); the layout follows the start-up timing, hence 2e-4. A wrong row or position is off by nats, not 1e-4.
ATOL = 2e-4


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...]) -> torch.Tensor:
    model = loaded_model().model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits, dim=-1)


def assert_matches_reference(prompt: list[int], entries: list) -> None:
    """entries[i] is the logprob of prompt[i + 1] from position i: [logprob, [[id, logprob], ...top]]."""
    raw = _reference(tuple(prompt))
    assert len(entries) == len(prompt) - 1
    got = torch.tensor([e[0] for e in entries])
    expected = raw[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    top = torch.topk(raw[:-1], TOP, dim=-1)
    for i, (_, tops) in enumerate(entries):
        assert [t[0] for t in tops] == top.indices[i].tolist(), f"position {i}"
        torch.testing.assert_close(torch.tensor([t[1] for t in tops]), top.values[i], atol=ATOL, rtol=0)


def request(request_id: str, prompt: list[int], max_tokens: int = 3, **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, prompt_logprobs=TOP, **params))


def only_prompt_logprobs(outputs: list) -> list:
    sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1, f"prompt logprobs sent {len(sent)} times"
    assert outputs[0].prompt_logprobs is not None  # with the first output
    return sent[0]


@pytest.mark.parametrize("budget", [2048, 48, 7])  # one chunk; several chunks (7: chunks not block-aligned)
def test_prompt_logprobs_match_transformers_in_one_chunk_or_many(prompts, budget):
    engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=budget)
    chosen = [prompts[1], prompts[3]]
    outs = run_outputs(engine, [request(f"r{i}", p) for i, p in enumerate(chosen)])
    for i, prompt in enumerate(chosen):
        assert_matches_reference(prompt, only_prompt_logprobs(outs[(f"r{i}", 0)]))
        tokens = [t for o in outs[(f"r{i}", 0)] for t in o.new_token_ids]
        assert tokens == reference_greedy(prompt, 3)  # the first token still comes from the last prompt row
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_cached_prefix_does_not_shortcut_prompt_logprobs(prompts):
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=64)
    prompt = prompts[4]
    plain = run_outputs(engine, [EngineRequest("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    assert plain[("warm", 0)][0].prompt_logprobs is None  # not asked, not sent
    for round_ in range(2):
        outs = run_outputs(engine, [request(f"x{round_}", prompt)])[(f"x{round_}", 0)]
        assert outs[0].num_cached_tokens == 0  # every prompt position computed
        assert_matches_reference(prompt, only_prompt_logprobs(outs))
    # Its blocks still went to the prefix cache: a plain request hits them.
    again = run_outputs(engine, [EngineRequest("hit", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    assert again[("hit", 0)][0].num_cached_tokens > 0


def test_prompt_logprobs_are_sent_once_across_preemption(prompts):
    # 12 blocks of 16 tokens cannot hold every sequence at once: the newest are preempted and recomputed.
    engine = make_engine(kv_cache_memory=12 * engine_block_bytes(), max_num_batched_tokens=32)
    preempted = record_preemptions(engine)
    short = [p for p in prompts if len(p) < 100] * 2
    outs = run_outputs(engine, [request(f"r{i}", p, max_tokens=24) for i, p in enumerate(short)])
    assert preempted, "the pool was meant to run out"
    for i, prompt in enumerate(short):
        assert_matches_reference(prompt, only_prompt_logprobs(outs[(f"r{i}", 0)]))
        assert [t for o in outs[(f"r{i}", 0)] for t in o.new_token_ids] == reference_greedy(prompt, 24)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_n_choices_get_them_once_and_max_tokens_zero_computes_only_the_prompt(prompts):
    engine = make_engine()
    prompt = prompts[2]
    outs = run_outputs(engine, [request("n", prompt, n=3, temperature=1.0, ignore_eos=True)])
    assert sorted(outs) == [("n", 0), ("n", 1), ("n", 2)]
    assert_matches_reference(prompt, only_prompt_logprobs(outs[("n", 0)]))
    assert all(o.prompt_logprobs is None for i in (1, 2) for o in outs[("n", i)])

    outs = run_outputs(engine, [request("z", prompt, max_tokens=0, n=2)])
    for i in (0, 1):
        (out,) = outs[("z", i)]
        assert out.new_token_ids == [] and out.finish_reason == "length" and out.logprobs is None
    assert_matches_reference(prompt, outs[("z", 0)][0].prompt_logprobs)
    assert outs[("z", 1)][0].prompt_logprobs is None

    (out,) = run_outputs(engine, [EngineRequest("e", prompt, SamplingParams(max_tokens=0))])[("e", 0)]
    assert out.new_token_ids == [] and out.finish_reason == "length"  # nothing asked of the model at all
    assert engine.pool.num_free == engine.pool.num_blocks
