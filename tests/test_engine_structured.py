"""Structured outputs in the engine core, in-process with the embedded model: masked sampling beside unconstrained
sequences, n > 1 and seeds, logprobs of the masked distribution, preemption and chunked prefill, a grammar the
engine cannot compile, and the serve loop's compiling requests."""
import json
import math
import re
import select

import jsonschema
import pytest

from enginecore.grammar_compiler import CompilingRequests
from ipc import grammar as grammars
from ipc.messages import EngineRequest, FinishReason
from ipc.sampling import SamplingParams
from tests.test_engine_support import (  # noqa: F401
    chat_prompt, engine_block_bytes, greedy_request, loaded_model, make_engine, prompts, record_preemptions,
    reference_greedy, tokenizer,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WORDS = r"[a-z]+( [a-z]+){3,6}\."
CITIES = ["Paris", "London", "Berlin"]


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _run(engine, requests) -> tuple[dict, dict]:
    """Every choice's tokens and its last output, by (request id, index)."""
    tokens, last = {}, {}
    for request in requests:
        for out in engine.add_request(request):
            last[(out.request_id, out.index)] = out
    while engine.has_work():
        for _, out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            last[(out.request_id, out.index)] = out
    return tokens, last


def _text(ids) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def test_constrained_beside_unconstrained(engine, prompts):
    person = chat_prompt("Describe a person as JSON with a name and an age.")
    schema = grammars.json_schema_grammar(PERSON)
    requests = [
        greedy_request("plain", prompts[1], 12),
        greedy_request("json", person, 48, grammar=schema),
        EngineRequest("seeded", person, SamplingParams(max_tokens=48, temperature=0.9, seed=7, n=3, grammar=schema)),
        greedy_request("words", prompts[2], 24, grammar=grammars.regex_grammar(WORDS)),
    ]
    tokens, last = _run(engine, requests)
    assert tokens[("plain", 0)] == reference_greedy(prompts[1], 12)  # the unconstrained row is untouched
    for key in [("json", 0), ("seeded", 0), ("seeded", 1), ("seeded", 2)]:
        jsonschema.validate(json.loads(_text(tokens[key])), PERSON)
        assert last[key].finish_reason == FinishReason.STOP  # the grammar's end, before max_tokens
    assert len({tuple(tokens[("seeded", i)]) for i in range(3)}) > 1  # three choices, three draws
    assert re.fullmatch(WORDS, _text(tokens[("words", 0)]))
    again, _ = _run(engine, [requests[2]])
    assert [again[("seeded", i)] for i in range(3)] == [tokens[("seeded", i)] for i in range(3)]


def test_logprobs_are_those_of_the_masked_distribution(engine, prompts):
    engine.add_request(greedy_request("city", prompts[1], 8, grammar=grammars.choice_grammar(CITIES), logprobs=5))
    outputs = []
    while engine.has_work():
        outputs += [out for _, out in engine.step()]
    assert _text([t for out in outputs for t in out.new_token_ids]) in CITIES
    (sampled, top), = outputs[0].logprobs
    allowed = [(token, lp) for token, lp in top if lp > -math.inf]
    assert allowed and all(any(c.startswith(_text([t])) for c in CITIES) for t, _ in allowed)
    assert sum(math.exp(lp) for _, lp in allowed) > 0.99  # (almost) all the mass is in them
    assert sampled == pytest.approx(top[0][1])


def test_preemption_and_chunked_prefill_keep_the_constraint(prompts):
    """Small KV pool and token budget: prompts go in chunks, and an urgent request preempts the constrained ones
    halfway; they recompute and go on under their grammar, with the same tokens as when run alone."""
    schema = grammars.json_schema_grammar(PERSON)
    sampling = dict(max_tokens=40, temperature=0.8, seed=11, grammar=schema)
    person = chat_prompt("Describe a person as JSON with a name and an age. " * 3)
    alone, _ = _run(make_engine(), [EngineRequest("low0", person, SamplingParams(**sampling))])
    engine = make_engine(scheduling_policy="priority", max_num_seqs=2, max_num_batched_tokens=32)
    preempted = record_preemptions(engine)
    for i, priority in enumerate([5, 3]):
        engine.add_request(EngineRequest(f"low{i}", person, SamplingParams(**sampling), priority=priority))
    tokens = {}
    for step in range(400):
        if step == 12:  # both decoding by now (the prompt took 3 chunks each)
            engine.add_request(EngineRequest("urgent", prompts[2], SamplingParams(max_tokens=4, temperature=0),
                                             priority=0))
        for _, out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_work():
            break
    assert "low0" in preempted
    for request_id in ("low0", "low1"):
        jsonschema.validate(json.loads(_text(tokens[request_id])), PERSON)
    assert tokens["low0"] == alone[("low0", 0)]


def test_a_grammar_the_engine_cannot_compile_fails_its_request_alone(engine, prompts):
    bad = EngineRequest("bad", prompts[1], SamplingParams(max_tokens=4, n=2, grammar='{"grammars": [{"lark_grammar": "start: nope"}]}'))
    outputs = engine.add_request(bad)
    assert [(o.index, o.finish_reason) for o in outputs] == [(0, FinishReason.ERROR), (1, FinishReason.ERROR)]
    assert "nope" in outputs[0].error
    tokens, _ = _run(engine, [greedy_request("fine", prompts[1], 3)])
    assert tokens[("fine", 0)] == reference_greedy(prompts[1], 3)


def test_the_serve_loop_holds_a_request_while_its_grammar_compiles(engine, prompts):
    compiling = CompilingRequests(engine.structured.compiler)
    fresh = grammars.regex_grammar("[0-9]{4}-[0-9]{2}")  # no request has used it: not compiled yet
    request = EngineRequest("held", prompts[1], SamplingParams(max_tokens=8, temperature=0, grammar=fresh))
    assert compiling.hold(b"api-0", request)
    dropped = EngineRequest("dropped", prompts[1], SamplingParams(max_tokens=8, n=2, grammar=fresh + " "))
    assert compiling.hold(b"api-0", dropped)
    assert [(o.index, o.finish_reason) for o in compiling.abort(b"api-0", ["dropped"])] == [(0, "abort"), (1, "abort")]
    ready = compiling.ready()
    while not ready:
        assert select.select([compiling], [], [], 30)[0], "no compile finished in 30 s"  # it wakes the loop
        ready = compiling.ready()
    assert ready == [(b"api-0", request, [])]  # no choice of it was aborted meanwhile
    assert engine.structured.compiler.cached(fresh) is not None
    assert not compiling.hold(b"api-0", request)  # compiled: straight to the engine
    tokens, _ = _run(engine, [request])
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", _text(tokens[("held", 0)]))


def test_a_constrained_row_keeps_its_own_mask_when_the_batch_is_sampled_row_by_row(engine, prompts):
    """A row the sampler cannot take (top_p "x") makes the step sample its rows again one by one: each constrained
    row under its own row of the mask, from logits the batch attempt left untouched; only the culprit fails."""
    words = greedy_request("words", prompts[2], 24, grammar=grammars.regex_grammar(WORDS))
    city = EngineRequest("city", prompts[1], SamplingParams(max_tokens=8, temperature=0.9, seed=3,
                                                           grammar=grammars.choice_grammar(CITIES)))
    alone, _ = _run(engine, [words, city])
    bad = EngineRequest("bad", prompts[0], SamplingParams(max_tokens=8, temperature=1.0, top_p="x"))
    tokens, last = _run(engine, [greedy_request("plain", prompts[1], 12), bad, words, city])
    assert last[("bad", 0)].finish_reason == FinishReason.ERROR and "TypeError" in last[("bad", 0)].error
    assert tokens[("plain", 0)] == reference_greedy(prompts[1], 12)
    assert tokens[("words", 0)] == alone[("words", 0)] and re.fullmatch(WORDS, _text(tokens[("words", 0)]))
    assert tokens[("city", 0)] == alone[("city", 0)] and _text(tokens[("city", 0)]) in CITIES
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests


def test_the_sampler_masks_its_own_copy_of_the_logits(engine):
    """sample() and sample_each() leave the step's logits as they were, and agree: row 1 may take token 5 only."""
    import numpy as np
    import torch

    from enginecore.sequence import Sequence
    from enginecore.structured_output import TokenMask

    seqs = [Sequence(seq_id=i, request_id=f"r{i}", client=None, index=0, token_ids=[1, 2], num_prompt_tokens=2,
                     sampling=SamplingParams(temperature=0.0, logprobs=1), priority=0, arrival=i) for i in range(2)]
    bits = np.zeros((1, (engine.vocab_size + 31) // 32), dtype=np.int32)
    bits[0, 0] = 1 << 5
    mask = TokenMask([1], bits, engine.vocab_size)
    logits = torch.randn(2, engine.vocab_size)
    before = logits.clone()
    batch = engine.sampler.sample(logits, seqs, mask)
    assert torch.equal(logits, before)
    each = engine.sampler.sample_each(logits, seqs, mask)
    assert torch.equal(logits, before)
    assert batch.token_ids == each.token_ids == [int(before[0].argmax()), 5]
    assert each.errors == [None, None] and batch.logprobs[1][0] == pytest.approx(0.0)  # all the mass on token 5


def test_the_serve_loop_hands_on_choices_aborted_while_the_grammar_compiled(engine, prompts):
    compiling = CompilingRequests(engine.structured.compiler)
    # A request the engine cannot take is never held: add_request fails it alone.
    assert not compiling.hold(b"api-1", EngineRequest("odd", [1, "x"], SamplingParams(grammar="{}")))
    fresh = grammars.regex_grammar("[0-9]{3}-[a-z]{3}")
    request = EngineRequest("partly", prompts[1], SamplingParams(max_tokens=8, n=3, temperature=0, grammar=fresh))
    assert compiling.hold(b"api-1", request)
    assert compiling.abort(b"api-1", ["partly"], [1]) == []  # stopped once it reaches the engine
    assert compiling.abort(b"api-1", "partly") == [] and compiling.abort(b"api-1", [["partly"]]) == []  # ignored
    ready = compiling.ready()
    while not ready:
        assert select.select([compiling], [], [], 30)[0], "no compile finished in 30 s"
        ready = compiling.ready()
    assert ready == [(b"api-1", request, [1])]


@pytest.mark.parametrize("grammar, words", [
    # Past llguidance's lexer limits at the first token (it builds its lexer lazily: the grammar compiles).
    (grammars.regex_grammar("b{888888}"), "too many expressions"),
    # Unsatisfiable: no output at all (the matcher's first mask allows EOS alone, and errs).
    (grammars.json_schema_grammar({"$ref": "#"}), "no output at all"),
])
def test_a_grammar_that_fails_at_its_first_step_fails_every_time(engine, prompts, grammar, words):
    """The API servers refuse these before queueing (ipc.grammar.check); the engine, given one anyway, fails it
    with a short reason, every time: its compiled matcher is not cached (its copies share a spent lexer), so a
    repeat never ends as an empty output that looks complete (a 'stop')."""
    errors = []
    for i in range(3):
        _, last = _run(engine, [greedy_request(f"fails{i}", prompts[1], 5, grammar=grammar, logprobs=1)])
        out = last[(f"fails{i}", 0)]
        assert out.finish_reason == FinishReason.ERROR, out
        assert grammars.is_engine_error(out.error) and words in out.error
        assert "<state>" not in out.error and "\n" not in out.error and len(out.error) < 400
        assert engine.structured.compiler.cached(grammar) is None
        errors.append(out.error)
    assert errors[0] == errors[1] == errors[2]
    tokens, _ = _run(engine, [greedy_request("fine", prompts[1], 3)])
    assert tokens[("fine", 0)] == reference_greedy(prompts[1], 3)


def test_thousands_of_choices_compile_into_one_lexeme(engine, prompts):
    """llguidance refuses a Lark rule of 2,000 alternatives or more: the choices become one regex (a trie)."""
    labels = [f"label-{i:04d}" for i in range(2500)] + ["a/b.c*", "line\nbreak", "é✓"]
    grammar = grammars.choice_grammar(labels)
    grammars.check(grammar)
    tokens, last = _run(engine, [EngineRequest("labels", prompts[1], SamplingParams(
        max_tokens=16, temperature=1.0, seed=4, n=3, grammar=grammar))])
    for i in range(3):
        assert _text(tokens[("labels", i)]) in labels and last[("labels", i)].finish_reason == FinishReason.STOP
