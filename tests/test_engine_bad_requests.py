"""A request the engine cannot serve fails alone, in-process: the engine keeps serving the others, correctly."""
import pytest

from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams
from tests.test_engine_support import (  # noqa: F401
    greedy_request, make_engine, prompts, reference_greedy, run_outputs,
)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _tokens(outputs, key):
    return [t for out in outputs[key] for t in out.new_token_ids]


def test_the_largest_seed_with_two_choices_is_served(engine, prompts):
    params = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    top = EngineRequest("top", prompts[1], SamplingParams(seed=2**64 - 1, n=2, **params))
    out = run_outputs(engine, [top])
    assert [out[("top", i)][-1].finish_reason for i in (0, 1)] == ["length", "length"]
    # Choice i is seeded seed + i, wrapped into [0, 2**64): choice 1 draws as a request seeded 0 does.
    zero = run_outputs(engine, [EngineRequest("zero", prompts[1], SamplingParams(seed=0, **params))])
    assert _tokens(out, ("top", 1)) == _tokens(zero, ("zero", 0))
    assert len(_tokens(out, ("top", 0))) == 6
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_row_the_sampler_cannot_take_fails_its_request_alone(engine, prompts):
    seeded = dict(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = run_outputs(engine, [EngineRequest("seeded", prompts[2], SamplingParams(**seeded))])
    # top_p "x" passes the engine's checks at add (the sampler's fields are the sampler's) and raises in the
    # sampler, after the batch's logits were divided by the temperatures: the rows are sampled again one by one.
    bad = EngineRequest("bad", prompts[0], SamplingParams(max_tokens=8, temperature=1.0, top_p="x", n=2))
    crowd = run_outputs(engine, [greedy_request("greedy", prompts[1], 8), bad,
                          EngineRequest("seeded", prompts[2], SamplingParams(**seeded))])
    for i in (0, 1):
        (failed,) = crowd[("bad", i)]
        assert failed.finish_reason == "error" and failed.new_token_ids == []
        assert "TypeError" in failed.error and "\n" not in failed.error
    assert _tokens(crowd, ("greedy", 0)) == reference_greedy(prompts[1], 8)
    assert _tokens(crowd, ("seeded", 0)) == _tokens(alone, ("seeded", 0))
    assert engine.stats()["num_failed"] >= 1
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests


def test_a_grammar_that_is_not_text_fails_its_request_alone(engine, prompts):
    bad = EngineRequest("bad", prompts[1], SamplingParams(max_tokens=4, n=2, grammar={"regex": "[a-z]+"}))
    (first, second) = engine.add_request(bad)
    assert first.finish_reason == second.finish_reason == "error" and "grammar" in first.error
    assert not engine.requests


@pytest.mark.parametrize("ordinal,error", [(-1, "must not be negative"), ("3", "must be an integer"),
                                           (True, "must be an integer")])
def test_an_ordinal_the_fair_share_cannot_take_fails_its_request_alone(engine, prompts, ordinal, error):
    """A negative ordinal would put its request ahead of every other in the fair share (enginecore.scheduler)."""
    bad = EngineRequest("bad", prompts[1], SamplingParams(max_tokens=4), ordinal=ordinal)
    (out,) = engine.add_request(bad)
    assert out.finish_reason == "error" and error in out.error and not engine.requests
    far = EngineRequest("far", prompts[1], SamplingParams(max_tokens=2, temperature=0.0), ordinal=2**62)
    assert _tokens(run_outputs(engine, [far]), ("far", 0)) and not engine.requests  # a far turn is still served
