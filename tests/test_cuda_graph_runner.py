"""enginecore.cuda_graphs.CudaGraphRunner on the CPU: its buckets, its padding and its static buffers, in a whole
engine run, with a stand-in for the CUDA capture.

A CUDA graph replays the kernels it recorded on the addresses it recorded: what a step changes reaches it only
through the static buffers the runner copies the step's inputs into. The stand-in keeps exactly that contract (its
replay recomputes the captured function from the same static buffers into the same output), so a value the runner
forgets to copy is stale here as on a GPU, and the tokens go wrong. Flash varlen attention is replaced by its plain
torch reference (attention.varlen_reference), as in tests/test_attention.py. tests/test_engine_cuda.py runs the
real graphs on a GPU."""
from collections import Counter

import pytest
import torch
from enginecore import attention
from enginecore import cuda_graphs
from enginecore.cuda_graphs import CudaGraphRunner, blocks_bucket, graphs_unsupported, token_buckets
from enginecore.sequence import Sequence
from enginecore.step_inputs import DecodePadding, MixedPadding
from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams
from tests.test_engine_support import (  # noqa: F401
    greedy_request, make_engine, prompts, reference_greedy, run_outputs,
)

MAX_GRAPH_TOKENS = 48


class StandInCapture:
    """What torch.cuda.graph gives the runner, on the CPU: replay recomputes fn from its static buffers in place.
    Counts replays by kind: decode graphs are keyed (batch, blocks), the others (tokens, runs, blocks)."""

    def __init__(self):
        self.replays = Counter()

    def __call__(self, fn):
        output = fn()
        kind = "decode" if output.shape[-1] > 1000 else "mixed"  # logits (vocab) or the layers' output (hidden)

        def replay():
            self.replays[kind] += 1
            output.copy_(fn())

        return replay, output


def graph_engine(monkeypatch, **settings):
    monkeypatch.setattr(attention, "flash_varlen", attention.varlen_reference)
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64, **settings)
    eager = engine.runner
    eager.varlen = True  # as on CUDA in half precision
    capture = StandInCapture()
    engine.runner = CudaGraphRunner(eager, 8, engine.max_model_len, MAX_GRAPH_TOKENS, capture=capture)
    engine.runner.capture_common()
    return engine, capture


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_steps_give_transformers_greedy_tokens(monkeypatch, prompts, async_scheduling):
    """Five prompts of 10 to 300 tokens arriving over the first steps, chunked by a 64-token budget: steps mix
    decodes with prompt chunks, some over the graph limit (eager), most under it (graphs of the layers), and the
    decode-only ones replay decode graphs. Every token equals plain transformers'; prompt logprobs, whose rows the
    eager head computes after a graph, equal the eager engine's."""
    # (No long-prefill cap: 64-token chunks beside decodes are the steps over the graph limit.)
    engine, capture = graph_engine(monkeypatch, async_scheduling=async_scheduling, long_prefill_token_threshold=0)
    want = {f"r{i}": reference_greedy(p, 12) for i, p in enumerate(prompts)}
    arrivals = list(enumerate(prompts))
    got: dict[str, list[int]] = {}
    logprobs = []
    steps = 0
    while arrivals or engine.has_work():
        if arrivals and steps % 2 == 0:  # one new request every other step
            i, prompt = arrivals.pop(0)
            sampling = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2 if i == 2 else None)
            for out in engine.add_request(EngineRequest(f"r{i}", prompt, sampling)):
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for _, out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.prompt_logprobs:
                logprobs.append(out.prompt_logprobs)
        steps += 1
    assert got == want
    assert capture.replays["mixed"] >= 5 and capture.replays["decode"] >= 5, capture.replays
    assert engine.step_counts.graph_steps == sum(capture.replays.values())
    assert engine.step_counts.graph_steps < engine.step_counts.steps  # the 64-token chunks ran eagerly

    eager = run_outputs(make_engine(max_num_seqs=8, max_num_batched_tokens=64),
                        [EngineRequest("r2", prompts[2], SamplingParams(max_tokens=1, prompt_logprobs=2))])
    eager_logprobs = [out.prompt_logprobs for out in eager[("r2", 0)] if out.prompt_logprobs]
    assert _flat(logprobs) == pytest.approx(_flat(eager_logprobs), abs=1e-3)


def _flat(prompt_logprobs: list) -> list[float]:
    return [lp for chunk in prompt_logprobs for entry in chunk for lp in _numbers(entry)]


def _numbers(entry):
    if isinstance(entry, (int, float)):
        yield float(entry)
    elif isinstance(entry, (list, tuple)):
        for item in entry:
            yield from _numbers(item)


def _seq(tokens: list[int], computed: int, blocks: iter) -> Sequence:
    return Sequence(seq_id=0, request_id="x", client=None, index=0, token_ids=tokens, num_prompt_tokens=len(tokens),
                    sampling=SamplingParams(), priority=0, arrival=0, num_computed_tokens=computed,
                    block_table=[next(blocks) for _ in range(-(-len(tokens) // 16))])


def test_a_graph_replays_other_steps_of_its_shape(monkeypatch, prompts):
    """Two different steps of one bucket (16 tokens, 4 runs, 7 blocks): the second replays the graph the first
    captured, and both give the eager forward's logits. Every value that differs between them (token ids,
    positions, slots, blocks, run bounds, context lengths) must reach the graph through its buffers."""
    engine, capture = graph_engine(monkeypatch)
    runner = engine.runner
    torch.manual_seed(0)
    engine.kv_cache.tensor.normal_(std=0.5)  # contexts "already computed": whatever the cache holds
    blocks = iter(torch.randperm(engine.kv_cache.num_blocks).tolist())
    words = prompts[4]
    first = [(_seq(words[:20], 19, blocks), 1), (_seq(words[5:38], 32, blocks), 1), (_seq(words[40:52], 0, blocks), 12)]
    second = [(_seq(words[1:41], 39, blocks), 1), (_seq(words[60:82], 16, blocks), 6), (_seq(words[90:95], 0, blocks), 5)]
    for step in (first, second):
        inputs = runner.prepare(step)
        assert inputs.graph_shape == (16, 4, 7)
        got = runner.forward(inputs)
        want = runner.eager.forward(runner.eager.prepare(step))
        assert got.shape == want.shape == (3, want.shape[1])
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert capture.replays["mixed"] == 2 and runner.shapes[-1] == (16, 4, 7) \
        and len(runner.shapes) == len(runner.batch_buckets) * len(runner.block_buckets[:2]) + 1


def test_which_graph_a_step_gets(monkeypatch, prompts):
    engine, _ = graph_engine(monkeypatch)
    runner, words = engine.runner, prompts[4]
    blocks = iter(range(engine.kv_cache.num_blocks))
    decodes = [(_seq(words[:20], 19, blocks), 1), (_seq(words[:40], 39, blocks), 1), (_seq(words[:3], 2, blocks), 1)]
    assert runner._padding(decodes) == DecodePadding(4, 16, engine.kv_cache.scratch_block)  # 256 tokens a row
    # One token of a prompt that is not its last: not a decode (not sampled); a graph of at least 2 tokens, as
    # flash's decode path (max_q 1) cannot take padding runs.
    chunk = [(_seq(words[:30], 10, blocks), 1)]
    assert runner._padding(chunk) == MixedPadding(2, 2, 2, engine.kv_cache.scratch_block)
    prefill = [(_seq(words[:MAX_GRAPH_TOKENS + 1], 0, blocks), MAX_GRAPH_TOKENS + 1)]
    assert runner._padding(prefill) is None  # over --cuda-graph-max-tokens: eager
    # 43 tokens, 4 runs and 4 of padding, 9 blocks and one per padding run (13, a quarter octave up: 14).
    assert runner._padding(decodes + [(_seq(words[:40], 0, blocks), 40)]) == \
        MixedPadding(MAX_GRAPH_TOKENS, 8, 14, engine.kv_cache.scratch_block)
    # A decode-only step past the longest decode graph's context (MAX_GRAPH_CONTEXT; here the first bucket's):
    # eager, not a graph of the layers.
    runner.block_buckets = runner.block_buckets[:1]
    long = (words * 4)[:300]
    assert runner._padding([(_seq(long, 299, blocks), 1)]) is None
    no_mixed = CudaGraphRunner(runner.eager, 8, engine.max_model_len, 0, capture=StandInCapture())
    assert no_mixed._padding(chunk) is None and no_mixed._padding(decodes) is not None


def test_graphs_of_steps_with_prompt_tokens_are_capped(monkeypatch, prompts):
    """A server whose load keeps changing would capture graphs without end: past the cap, steps of new shapes run
    eagerly, those of shapes already captured still replay theirs."""
    engine, capture = graph_engine(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "MAX_MIXED_GRAPHS", 1)
    runner, words = engine.runner, prompts[4]
    blocks = iter(range(engine.kv_cache.num_blocks))
    first = [(_seq(words[:20], 19, blocks), 1), (_seq(words[:10], 0, blocks), 10)]
    other = [(_seq(words[:20], 19, blocks), 1), (_seq(words[:30], 0, blocks), 30)]
    runner.forward(runner.prepare(first))
    assert capture.replays["mixed"] == 1
    assert runner.prepare(other).graph_shape is None
    assert runner.prepare(first).graph_shape == runner.shapes[-1]


def test_a_failed_capture_of_a_step_with_prompt_tokens_falls_back_to_eager(monkeypatch, prompts, caplog):
    """The new kind of graph failing to capture (a GPU or torch build it does not suit) costs the graphs of such
    steps, not the engine: the step runs eagerly, padded as it is, with the same logits, and so do later ones."""
    engine, capture = graph_engine(monkeypatch)
    runner, words = engine.runner, prompts[4]
    blocks = iter(range(engine.kv_cache.num_blocks))
    step = [(_seq(words[:20], 19, blocks), 1), (_seq(words[:10], 0, blocks), 10)]

    def failing(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._capture_fn = failing
    inputs = runner.prepare(step)
    assert inputs.graph_shape is not None
    got = runner.forward(inputs)
    torch.testing.assert_close(got, runner.eager.forward(runner.eager.prepare(step)), atol=2e-3, rtol=2e-3)
    assert "run eagerly from now on" in caplog.text
    assert runner.prepare(step).graph_shape is None
    decodes = [(_seq(words[:20], 19, blocks), 1)]
    assert runner.prepare(decodes).graph_shape is not None  # decode graphs stay


def test_models_whose_rope_tables_change_with_the_positions_get_no_graphs():
    """transformers recomputes dynamic and longrope tables when the positions pass its cache, reading the largest
    position on the host: a capture fails on that sync (the engine would not start), and a replay would keep stale
    tables."""
    from transformers import LlamaConfig

    assert graphs_unsupported(LlamaConfig()) is None
    assert graphs_unsupported(LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                        "original_max_position_embeddings": 8192,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0})) is None
    assert "dynamic" in graphs_unsupported(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert "longrope" in graphs_unsupported(LlamaConfig(
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                      "original_max_position_embeddings": 2048}, max_position_embeddings=8192))


def test_buckets():
    assert [blocks_bucket(n) for n in (1, 7, 8, 9, 17, 100, 2100, 3000, 4096)] == \
        [1, 7, 8, 10, 20, 112, 2560, 3072, 4096]
    for n in range(1, 5000):
        assert n <= blocks_bucket(n) <= n * 1.25
    assert token_buckets(48)[-3:] == [32, 40, 48] and token_buckets(1024)[-2:] == [992, 1024]
    large = token_buckets(8192)
    assert large[large.index(1024):][:3] == [1024, 1280, 1536] and large[-2:] == [7936, 8192]
    for n in range(2, 8193):  # every step gets a bucket at most a quarter larger (31 tokens larger when small)
        bucket = next(b for b in large if b >= n)
        assert bucket <= max(n * 1.25, n + 31)


def test_the_kv_cache_leaves_room_for_the_graphs_pool():
    """cuda_setup.reserved_bytes: the pool of graphs of steps with prompt tokens holds about their share of the
    largest step's activations; a small one fits the fixed allowance, a large one gets its own room."""
    from enginecore.cuda_setup import GRAPH_AND_SLACK_BYTES, reserved_bytes

    gib = 2**30
    assert reserved_bytes(4 * gib, gib, 0, 8192) == 5 * gib + GRAPH_AND_SLACK_BYTES  # no such graphs
    assert reserved_bytes(gib, 0, 1024, 8192) == gib + GRAPH_AND_SLACK_BYTES  # 128 MB: within the allowance
    assert reserved_bytes(8 * gib, 0, 1024, 8192) == 9 * gib + GRAPH_AND_SLACK_BYTES // 2  # 1 GiB of its own
    assert reserved_bytes(8 * gib, 0, 8192, 8192) == 16 * gib + GRAPH_AND_SLACK_BYTES // 2  # graphs as large
