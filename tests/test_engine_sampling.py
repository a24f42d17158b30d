"""The batched sampler and the request lifecycle: seeds, n choices, logprobs, stop conditions, penalties, abort,
priority."""
from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams
from tests.test_engine_support import (  # noqa: F401
    engine_block_bytes, greedy_request, make_engine, prompts, record_preemptions, reference_greedy,
)

import pytest


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _sampled(request_id, prompt, **params):
    params.setdefault("max_tokens", 12)
    return EngineRequest(request_id, prompt, SamplingParams(**params))


def test_seeded_sampling_is_reproducible_in_any_batch(engine, prompts):
    seeded = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([_sampled("s", prompts[2], **seeded)])[("s", 0)]
    crowd = [_sampled(f"o{i}", p, temperature=1.0, ignore_eos=True) for i, p in enumerate(prompts)]
    crowd.insert(2, _sampled("s", prompts[2], **seeded))
    mixed = engine.generate(crowd)[("s", 0)]
    assert alone == mixed
    other_seed = engine.generate([_sampled("s", prompts[2], **{**seeded, "seed": 99})])[("s", 0)]
    assert other_seed != alone


def test_seeds_that_share_their_low_32_bits_draw_differently(engine, prompts):
    """torch's CPU generator keeps a seed's low 32 bits: 5 and 5 + 2**32 drew the same tokens, and -1 those of
    2**32 - 1. Each still draws the same every time."""
    def draw(seed):
        return engine.generate([_sampled(f"d{seed}", prompts[1], temperature=1.0, seed=seed, ignore_eos=True,
                                         max_tokens=16)])[(f"d{seed}", 0)]
    for a, b in ((5, 5 + 2**32), (-1, 2**32 - 1), (2**63 - 1, 2**32 - 1)):
        assert draw(a) != draw(b), (a, b)
    assert draw(5 + 2**32) == draw(5 + 2**32)


def test_n_choices_differ_and_share_the_prompt(engine, prompts):
    prompt = prompts[4][::-1]  # 228 tokens (14 full blocks) no other test sends: none of it is in the prefix cache
    prompt_tokens_before = engine.step_counts.prompt_tokens
    engine.add_request(_sampled("n", prompt, n=4, temperature=1.0, max_tokens=10, ignore_eos=True))
    outputs = {}
    most_used = 0
    while engine.has_work():
        for _, out in engine.step():
            outputs.setdefault(out.index, []).extend(out.new_token_ids)
        most_used = max(most_used, engine.pool.num_blocks - engine.pool.num_free)
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(t) == 10 for t in outputs.values())
    assert len({tuple(t) for t in outputs.values()}) > 1
    prompt_blocks = -(-len(prompt) // engine.block_size)
    # Four choices, the prompt's blocks held once and computed once, to the end: the forked choices had computed the
    # whole prompt again in the step after their fork, each into blocks of its own.
    assert most_used < 2 * prompt_blocks
    assert engine.step_counts.prompt_tokens - prompt_tokens_before == len(prompt)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_logprobs_format(engine, prompts):
    engine.add_request(greedy_request("lp", prompts[1], 3, logprobs=5))
    outs = []
    while engine.has_work():
        outs += [o for _, o in engine.step()]
    assert len(outs) == 3
    for out in outs:
        (entry,) = out.logprobs
        sampled, top = entry
        assert len(top) == 5 and top[0][0] == out.new_token_ids[0] and abs(top[0][1] - sampled) < 1e-5
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:])) and sampled <= 0


def test_stop_tokens_min_tokens_and_eos(engine, prompts):
    prompt = prompts[2]
    expected = reference_greedy(prompt, 20)
    stop = expected[3]
    first = expected.index(stop)
    engine.add_request(greedy_request("stop", prompt, 20, stop_token_ids=[stop]))
    outs = []
    while engine.has_work():
        outs += [o for _, o in engine.step()]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert [o.new_token_ids[0] for o in outs] == expected[:first + 1]

    # Greedy on "Hi!" ends with EOS; min_tokens bars it, ignore_eos runs to max_tokens.
    hi = prompts[0]
    greedy = reference_greedy(hi, 30)
    assert greedy[-1] in engine.eos_token_ids
    out = engine.generate([greedy_request("eos", hi, 30)])[("eos", 0)]
    assert out == greedy
    out = engine.generate([greedy_request("min", hi, 30, min_tokens=len(greedy) + 2)])[("min", 0)]
    assert len(out) >= len(greedy) + 2 and not set(out[:len(greedy) + 2]) & set(engine.eos_token_ids)
    out = engine.generate([greedy_request("ign", hi, 30, ignore_eos=True)])[("ign", 0)]
    assert len(out) == 30 and out[:len(greedy)] == greedy


def test_penalties_change_a_repetitive_output(engine, prompts):
    prompt = prompts[4]  # greedy repeats "The quick brown fox jumps over it."
    plain = engine.generate([greedy_request("p", prompt, 24)])[("p", 0)]
    # The repeats are very likely (large logit margins): penalties beyond the OpenAI range make the point.
    for params in (dict(repetition_penalty=1.5), dict(frequency_penalty=5.0), dict(presence_penalty=5.0)):
        out = engine.generate([greedy_request("q", prompt, 24, **params)])[("q", 0)]
        assert out != plain, params


def test_a_repetition_penalty_near_zero_repeats_rather_than_writing_garbage(engine, prompts):
    """Any penalty above 0 is taken (vLLM's range): 1e-39 divided a positive logit past float32 (inf), and a row of
    infinities sampled NaN probabilities, a page of one junk token. Near 0 it favours the prompt's tokens, as 1e-30
    does without overflowing: both must pick them alike."""
    prompt = prompts[4]
    outs = [engine.generate([greedy_request(f"r{i}", prompt, 12, repetition_penalty=penalty)])[(f"r{i}", 0)]
            for i, penalty in enumerate((1e-30, 1e-39, 5e-324))]
    assert all(set(out) <= set(prompt) for out in outs), outs
    sampled = engine.generate([_sampled("r3", prompt, temperature=1.0, seed=3, repetition_penalty=1e-39)])[("r3", 0)]
    assert set(sampled) <= set(prompt), sampled


def test_abort_frees_the_blocks(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(greedy_request(f"a{i}", p, 200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    outs = engine.abort([f"a{i}" for i in range(len(prompts))])
    assert sorted(o.request_id for o in outs) == sorted(f"a{i}" for i in range(len(prompts)))
    assert all(o.finish_reason == "abort" for o in outs)
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_work()


def _choices(engine, prompt, request_id, abort_at_step, indices):
    """Run an n=4 request, aborting `indices` of it before step `abort_at_step` (0: before its first step).
    Returns {index: (token ids, finish reasons)}."""
    engine.add_request(_sampled(request_id, prompt, n=4, temperature=1.0, max_tokens=8, ignore_eos=True))
    got = {}

    def record(out):
        tokens, reasons = got.setdefault(out.index, ([], []))
        tokens += out.new_token_ids
        reasons.append(out.finish_reason)

    step = 0
    while engine.has_work():
        if step == abort_at_step:
            aborted = engine.abort([request_id], indices=indices)
            assert sorted(o.index for o in aborted) == sorted(indices)
            assert all(o.finish_reason == "abort" and not o.new_token_ids for o in aborted)
            for out in aborted:
                record(out)
        for _, out in engine.step():
            record(out)
        step += 1
    assert not engine.requests and engine.pool.num_free == engine.pool.num_blocks
    return got


def test_abort_some_choices_of_a_running_request(engine, prompts):
    got = _choices(engine, prompts[3], "some", abort_at_step=2, indices=[1, 3])
    assert sorted(got) == [0, 1, 2, 3]
    for i in (0, 2):  # the others run to the end
        assert len(got[i][0]) == 8 and got[i][1][-1] == "length"
    for i in (1, 3):  # a token or two, then the abort, then nothing
        assert len(got[i][0]) < 8 and got[i][1][-1] == "abort" and got[i][1].count("abort") == 1


@pytest.mark.parametrize("indices", [[2], [0, 2], [0, 1, 2, 3]])
def test_abort_choices_not_forked_yet(engine, prompts, indices):
    # Before its first step the request is one sequence (choice 0) with choices 1-3 pending: abort some of them,
    # choice 0 included (the first pending choice then takes its place); the rest run in full.
    got = _choices(engine, prompts[3], f"pending{len(indices)}", abort_at_step=0, indices=indices)
    assert sorted(got) == [0, 1, 2, 3]
    for i in range(4):
        tokens, reasons = got[i]
        if i in indices:
            assert tokens == [] and reasons == ["abort"]
        else:
            assert len(tokens) == 8 and reasons[-1] == "length" and "abort" not in reasons


def test_priority_policy_runs_lower_values_first(prompts):
    engine = make_engine(scheduling_policy="priority", max_num_seqs=1)
    for i, priority in enumerate([5, 1, 3, 1]):
        engine.add_request(EngineRequest(f"p{i}", prompts[1], SamplingParams(max_tokens=2, temperature=0.0),
                                         priority=priority))
    finished = []
    while engine.has_work():
        finished += [o.request_id for _, o in engine.step() if o.finished]
    assert finished == ["p1", "p3", "p2", "p0"]


def _greedy(request_id, prompt, max_tokens, priority):
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), priority=priority)


def _run_with_late_urgent_request(engine, prompts, low_priorities):
    """Start low-priority greedy requests, then add an urgent one (priority 0) once they are decoding. Returns the
    order they finished in, every output, and the request ids preempted along the way."""
    preempted = record_preemptions(engine)
    for i, priority in enumerate(low_priorities):  # 85 prompt tokens: 6 blocks of 16, 7 by the 16th token
        engine.add_request(_greedy(f"low{i}", prompts[3], 16, priority))
    outputs, finished = {}, []
    for step in range(200):
        if step == 3:
            engine.add_request(_greedy("urgent", prompts[2], 4, priority=0))
        for _, out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
        if not engine.has_work():
            break
    return finished, outputs, preempted


def test_urgent_request_preempts_a_lower_priority_one_when_no_slot_is_free(prompts):
    engine = make_engine(scheduling_policy="priority", max_num_seqs=2)
    finished, outputs, preempted = _run_with_late_urgent_request(engine, prompts, [5, 3])
    assert preempted == ["low0"]  # the worse priority (higher value) of the two gives way
    assert finished[0] == "urgent"
    assert outputs["urgent"] == reference_greedy(prompts[2], 4)
    for request_id in ("low0", "low1"):  # recomputed after preemption: nothing lost, repeated or changed
        assert outputs[request_id] == reference_greedy(prompts[3], 16)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_urgent_request_preempts_a_lower_priority_one_when_no_block_is_free(prompts):
    # 15 blocks: the two low-priority sequences hold 12 when the urgent one (3 blocks) arrives, 1 kept in reserve.
    engine = make_engine(scheduling_policy="priority", kv_cache_memory=15 * engine_block_bytes(),
                         enable_prefix_caching=False)  # the two low ones would share their prompt blocks
    finished, outputs, preempted = _run_with_late_urgent_request(engine, prompts, [5, 3])
    assert preempted == ["low0"]
    assert finished[0] == "urgent"
    for request_id in ("low0", "low1"):
        assert outputs[request_id] == reference_greedy(prompts[3], 16)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_fcfs_never_preempts_for_a_newcomer(prompts):
    engine = make_engine(max_num_seqs=2)  # fcfs: the request's priority field is ignored
    finished, _, preempted = _run_with_late_urgent_request(engine, prompts, [5, 3])
    assert preempted == [] and finished[-1] == "urgent"


@pytest.mark.parametrize("params, expected", [
    (dict(), [0.2, 0.3, 0.5]),
    (dict(temperature=0.5), [0.2 ** 2 / 0.38, 0.3 ** 2 / 0.38, 0.5 ** 2 / 0.38]),
    (dict(top_p=0.6), [0.0, 0.375, 0.625]),
    (dict(top_k=2), [0.0, 0.375, 0.625]),
    (dict(min_p=0.5), [0.0, 0.375, 0.625]),
    (dict(top_k=1), [0.0, 0.0, 1.0]),
])
def test_sampler_distribution(params, expected):
    """Draw many rows from a known distribution over three tokens: the frequencies follow the filters."""
    import torch

    from enginecore.sampler import Sampler
    from enginecore.sequence import Sequence

    rows = 20000
    logits = torch.full((rows, 8), float("-inf"))
    logits[:, :3] = torch.tensor([0.2, 0.3, 0.5]).log()
    seq = Sequence(seq_id=0, request_id="d", client=None, index=0, token_ids=[5], num_prompt_tokens=1,
                   sampling=SamplingParams(**params), priority=0, arrival=0)
    tokens = Sampler(8, torch.device("cpu"), (7,)).sample(logits, [seq] * rows).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=8)[:3].float() / rows
    assert torch.allclose(freq, torch.tensor(expected), atol=0.015), freq


def test_prompt_logprobs_made_in_row_chunks_equal_them_made_at_once():
    """A step's prompt rows go through the log-softmax PROMPT_LOGPROB_ROWS at a time (the memory of a whole step's
    [rows, vocab] float32 copies at once could take down a GPU engine): the same entries as at once."""
    import torch

    from enginecore.sampler import PROMPT_LOGPROB_ROWS, SampledTokens, prompt_logprobs

    rows = 2 * PROMPT_LOGPROB_ROWS + 37
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, 1000, generator=g, dtype=torch.bfloat16)
    tokens = torch.randint(0, 1000, (rows,), generator=g).tolist()
    tops = [i % 6 for i in range(rows)]
    whole = SampledTokens(torch.tensor(tokens), torch.log_softmax(logits.float(), dim=-1), tops).result().logprobs
    assert prompt_logprobs(logits, tokens, tops) == whole


def test_logit_bias_bans_and_forces_tokens_only_in_its_own_rows(engine, prompts):
    prompt = prompts[2]
    expected = reference_greedy(prompt, 8)
    forced = 1234 if 1234 not in expected else 1235
    batch = [greedy_request("plain", prompt, 8),
             greedy_request("ban", prompt, 8, logit_bias_ids=[expected[0]], logit_bias_values=[-100.0]),
             greedy_request("force", prompt, 8, logit_bias_ids=[forced], logit_bias_values=[100.0], logprobs=0),
             _sampled("force-sampled", prompt, max_tokens=8, temperature=1.0, seed=7, logit_bias_ids=[forced],
                      logit_bias_values=[100.0])]
    outs = engine.generate(batch)
    assert outs[("plain", 0)] == expected
    assert outs[("ban", 0)][0] != expected[0]
    assert outs[("force", 0)] == [forced] * 8 and outs[("force-sampled", 0)] == [forced] * 8
    # Logprobs are the raw distribution's: the forced token was unlikely before its bias.
    engine.add_request(greedy_request("lp", prompt, 1, logit_bias_ids=[forced], logit_bias_values=[100.0], logprobs=0))
    outs = []
    while engine.has_work():
        outs += [o for _, o in engine.step()]
    (out,) = outs
    assert out.new_token_ids == [forced] and out.logprobs[0][0] < -5


def test_logit_bias_a_peer_sends_wrong_fails_alone_or_is_dropped(engine, prompts):
    """A hostile or buggy API server: ids outside the vocabulary (an index past the row is fatal on CUDA) and
    values that are not finite are dropped; lists of different lengths fail the request alone."""
    prompt = prompts[2]
    expected = reference_greedy(prompt, 6)
    outside = greedy_request("outside", prompt, 6, logit_bias_ids=[-1, 10**9, engine.vocab_size, 5],
                             logit_bias_values=[100.0, 100.0, 100.0, float("nan")])
    assert engine.generate([outside])[("outside", 0)] == expected
    (out,) = engine.add_request(greedy_request("uneven", prompt, 6, logit_bias_ids=[1, 2], logit_bias_values=[1.0]))
    assert out.finish_reason == "error" and "logit_bias" in out.error
    assert engine.generate([greedy_request("after", prompt, 6)])[("after", 0)] == expected
