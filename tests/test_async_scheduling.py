"""Asynchronous scheduling (--async-scheduling) gives the same outputs as scheduling step by step.

Under asynchronous scheduling the engine launches step k+1 before it has step k's tokens on the host: a decode
row reads its input token where step k sampled it, a sequence that step k finishes has one wasted row in step
k+1, and step k's outputs go out during step k+1. On the CPU that overlaps nothing, but every piece of the
bookkeeping runs, so these tests compare whole runs token for token, output for output (finish reasons, stop
tokens, logprobs, prompt logprobs, errors) against the same engine scheduling synchronously: greedy and seeded
choices, n > 1, EOS and stop tokens, min_tokens, penalties and grammars (which need the host's tokens first),
chunked prefill, preemption, aborts in flight, and the real `supervise --async-scheduling` group.
"""
import openai
from ipc import grammar as grammars
from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams
from tests.float_noise import floats_loosened
from tests.test_engine_support import (  # noqa: F401
    chat_prompt, engine_block_bytes, loaded_model, make_engine, prompts, record_preemptions, run_outputs, tokenizer,
)


def _requests(prompts: list[list[int]]) -> list[EngineRequest]:
    """A mix that exercises every path of a step's results."""
    person = chat_prompt("Describe a person as JSON with a name and an age.")
    schema = grammars.json_schema_grammar({"type": "object", "properties": {"name": {"type": "string"}},
                                           "required": ["name"], "additionalProperties": False})
    return [
        EngineRequest("greedy", prompts[0], SamplingParams(max_tokens=40, temperature=0.0)),  # ends at EOS
        EngineRequest("one", prompts[1], SamplingParams(max_tokens=1, temperature=0.0)),
        EngineRequest("seeded-n", prompts[2], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50,
                                                              seed=5, n=3)),
        EngineRequest("logprobs", prompts[3], SamplingParams(max_tokens=16, temperature=0.0, logprobs=3,
                                                              prompt_logprobs=2)),
        EngineRequest("stop", prompts[4], SamplingParams(max_tokens=30, temperature=0.7, seed=9,
                                                          stop_token_ids=[13, 30, 28], min_tokens=3)),
        EngineRequest("penalty", prompts[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                             repetition_penalty=1.3, frequency_penalty=0.5)),
        EngineRequest("prompt-only", prompts[2], SamplingParams(max_tokens=0, prompt_logprobs=1)),
        EngineRequest("json", person, SamplingParams(max_tokens=40, temperature=0.0, grammar=schema)),
        EngineRequest("ignore-eos", prompts[0], SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)),
    ]


def _normalized(outputs: dict) -> dict:
    """Every output as a comparable tuple (RequestOutput's fields)."""
    return {key: [(o.new_token_ids, o.finish_reason, o.stop_reason, o.num_prompt_tokens, o.num_cached_tokens,
                   o.logprobs, o.prompt_logprobs, o.error) for o in outs] for key, outs in outputs.items()}


def _compare(prompts, requests=None, preempted: dict | None = None, **settings) -> dict:
    """Runs the requests under both schedulings; asserts equal outputs and a clean pool; returns the async
    engine's outputs. `preempted`: filled with each scheduling's preempted request ids (False, True)."""
    results = {}
    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, **settings)
        assert engine.async_scheduling is mode
        if preempted is not None:
            preempted[mode] = record_preemptions(engine)
        results[mode] = _normalized(run_outputs(engine, requests or _requests(prompts)))
        assert engine.pending is None and not engine.requests
        assert engine.pool.num_free == engine.pool.num_blocks  # every block back, the wasted rows' too
    assert floats_loosened(results[True]) == floats_loosened(results[False])
    return results[True]


def test_same_outputs_as_step_by_step(prompts):
    outputs = _compare(prompts)
    assert sum(1 for key in outputs if key[0] == "seeded-n") == 3
    assert outputs[("greedy", 0)][-1][1] == "stop"  # finished at EOS, before max_tokens
    assert outputs[("one", 0)][0][0] and outputs[("one", 0)][-1][1] == "length"
    assert sum(len(o[0]) for o in outputs[("ignore-eos", 0)]) == 28


def test_same_outputs_with_chunked_prefill_and_few_slots(prompts):
    _compare(prompts, max_num_seqs=3, max_num_batched_tokens=64)


def test_same_outputs_across_preemption(prompts):
    """A pool of few blocks: sequences are preempted (some with a token still pending) and recomputed."""
    requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]
    sizes = sum(-(-(len(p) + 48) // 16) for p in prompts)
    preempted: dict = {}
    _compare(prompts, requests, preempted=preempted, kv_cache_memory=(sizes // 2) * engine_block_bytes())
    assert preempted[True], "the pool was meant to be too small for every sequence at once"


def test_a_row_the_sampler_cannot_take_fails_alone_as_step_by_step(prompts):
    """A batch whose sampling raises is sampled row by row (its tokens then on the host, not on the device where
    the next step would read them): the bad request fails, the others go on, as without asynchronous scheduling."""
    bad = EngineRequest("bad", prompts[0], SamplingParams(max_tokens=8, temperature=1.0, top_p="x", n=2))
    requests = [EngineRequest("greedy", prompts[1], SamplingParams(max_tokens=12, temperature=0.0)), bad,
                EngineRequest("seeded", prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=7))]
    outputs = _compare(prompts, requests)
    assert [o[1] for o in outputs[("bad", 0)]] == ["error"]
    assert sum(len(o[0]) for o in outputs[("greedy", 0)]) > 1


def test_abort_while_a_step_is_in_flight(prompts):
    """An abort between steps: the aborted choice's pending token is dropped, nothing of it comes out after its
    'abort' output, the others go on exactly as without the abort, and every block comes back."""
    outs = {}
    for mode in (False, True):
        engine = make_engine(async_scheduling=mode)
        requests = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(prompts[:3])]
        for request in requests:
            engine.add_request(request)
        got: dict = {}
        for _ in range(6):
            for _, out in engine.step():
                got.setdefault(out.request_id, []).append(out)
        if mode:
            assert engine.pending is not None  # the abort lands with a step in flight
        for out in engine.abort(["r1"]):
            got.setdefault(out.request_id, []).append(out)
        while engine.has_work():
            for _, out in engine.step():
                got.setdefault(out.request_id, []).append(out)
        assert got["r1"][-1].finish_reason == "abort"
        assert all(o.finish_reason is None for o in got["r1"][:-1])
        assert engine.pool.num_free == engine.pool.num_blocks
        outs[mode] = {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in got.items()}
    for rid in ("r0", "r2"):
        assert outs[True][rid] == outs[False][rid] and len(outs[True][rid]) == 32
    # Asynchronous: r1's outputs up to the abort lag one step behind, so it may have one token fewer.
    assert outs[False]["r1"][:len(outs[True]["r1"])] == outs[True]["r1"]


def test_supervise_async_scheduling_serves_the_same_text(start_supervise):
    """The real group with --async-scheduling on the CPU: a greedy chat answer, whole and streamed, equals the
    engine's own step-by-step output for the same prompt."""
    question = "Name three colours of the rainbow."
    engine = make_engine(async_scheduling=False)
    assert make_engine().async_scheduling is False  # the CPU's default
    expected = engine.generate([EngineRequest("x", chat_prompt(question),
                                              SamplingParams(max_tokens=24, temperature=0.0))])[("x", 0)]
    server = start_supervise("--async-scheduling", "--quantization", "none", "--dtype", "float32")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": question}]
    chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=messages)
    assert chat.choices[0].message.content == tokenizer().decode(expected, skip_special_tokens=True)
    stream = client.chat.completions.create(model=model, max_tokens=24, temperature=0, stream=True, messages=messages)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert "asynchronous scheduling on" in server.log()
