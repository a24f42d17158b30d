"""enginecore.paged_triton, the paged attention kernel that reads K/V from the cache blocks where they lie, compiled
on a CUDA GPU, else on the CPU through Triton's interpreter (tests/triton_setup.py): on random steps of every shape it serves (decodes,
prompt chunks after cached context, fresh prompts, CUDA graphs' padded rows, contexts split in ranges) it computes
what varlen_reference computes over the gathered context; and the engine's steps through it make the tokens the
SDPA paths make. tests/test_attention.py runs its step cases through it too; tests/test_engine_cuda.py runs it on a
GPU."""
import random

import pytest
import torch

from enginecore import attention, attention_plan
from enginecore.engine_base import BadEngineSetting
from tests.tiny_engine import greedy_tokens
from tests.triton_setup import DEVICE, HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="no Triton (the test extra installs it)")
CPU = torch.device("cpu")
# float32 on a GPU multiplies in TF32 (Triton's default for tl.dot), the interpreter in float32.
FLOAT32 = 1e-5 if DEVICE.type == "cpu" else 5e-3


@pytest.fixture(scope="module")
def paged_triton():
    from enginecore import paged_triton

    return paged_triton


def case(runs, heads, kv_heads, head_dim, dtype, block_size=16, seed=0, blocks_per_run=None):
    """A step of `runs` (new tokens, context length) on one layer's cache, blocks shuffled."""
    return attention_plan.make_case(runs, DEVICE, dtype, heads, kv_heads, head_dim, torch.Generator(device=DEVICE).manual_seed(seed),
                                block_size=block_size, blocks_per_run=blocks_per_run)


def relative_error(paged_triton, c: attention_plan.Case) -> float:
    got = paged_triton.paged(c.q, c.layer_kv, c.step, c.scaling).float()
    want = attention_plan.reference(c).float()
    assert got.isfinite().all()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 2, 32), (32, 8, 128), (6, 2, 48)],
                         ids=["mha", "smollm2", "group4", "llama8b", "head-dim-48"])
def test_decodes_and_chunks_match_the_reference(paged_triton, heads, kv_heads, head_dim):
    """Decodes of contexts around block and tile edges, a fresh prompt, chunks after cached context (one longer
    than a tile's queries), in float32: the summation order is all that may differ."""
    rng = random.Random(head_dim)
    decodes = [(1, c) for c in (1, 15, 16, 17, 63, 64, 65, 200)] + [(1, rng.randrange(1, 300)) for _ in range(6)]
    assert relative_error(paged_triton, case(decodes, heads, kv_heads, head_dim, torch.float32)) < FLOAT32
    mixed = decodes[:3] + [(7, 7), (20, 45), (70, 70), (33, 200), (1, 2)]
    assert relative_error(paged_triton, case(mixed, heads, kv_heads, head_dim, torch.float32, seed=1)) < FLOAT32


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_any_block_size(paged_triton, block_size):
    runs = [(1, 5), (1, 40), (9, 60), (1, 1)]
    assert relative_error(paged_triton, case(runs, 8, 2, 32, torch.float32, block_size=block_size)) < FLOAT32


def test_float16_matches_within_its_rounding(paged_triton):
    runs = [(1, 21), (3, 33), (1, 300), (40, 90)]
    assert relative_error(paged_triton, case(runs, 8, 8, 64, torch.float16)) < 2e-3


def test_few_long_decodes_split_their_keys_and_merge(paged_triton):
    """Two decodes of 700 and 1000 keys are too few programs for the (stand-in) multiprocessors: their keys go
    in ranges, merged by a second kernel; ranges past the shorter context see no key at all."""
    kv_heads = 2
    splits = paged_triton.decode_splits(2, kv_heads, 1008, paged_triton._multiprocessors(DEVICE))
    assert splits > 2
    assert relative_error(paged_triton, case([(1, 700), (1, 1000)], 8, kv_heads, 64, torch.float32)) < FLOAT32
    assert paged_triton.decode_splits(256, 8, 4096, 132) == 1  # a full batch fills the GPU without splitting
    assert paged_triton.decode_splits(1, 8, 100, 132) == 1  # a short context is not worth splitting


def test_graph_rows_padded_to_whole_buckets(paged_triton):
    """A CUDA graph's decode rows: every row's blocks padded to 32 with a scratch block, the last row padding."""
    c = case([(1, 300), (1, 37), (1, 1)], 9, 3, 64, torch.float32, blocks_per_run=32)
    assert c.step.max_k == 32 * 16
    assert relative_error(paged_triton, c) < FLOAT32


def test_every_output_is_written_and_queries_may_be_a_strided_view(paged_triton):
    """The lean forward hands attention a view of its fused q/k/v product: rows of heads + 2 kv_heads heads."""
    c = case([(1, 50), (12, 80), (1, 3)], 8, 2, 32, torch.float32)
    fused = torch.randn(c.q.shape[0], 8 + 4, 32, device=DEVICE)
    fused[:, :8] = c.q
    strided = fused[:, :8]
    assert not strided.is_contiguous()
    out = paged_triton.paged(strided, c.layer_kv, c.step, c.scaling)
    torch.testing.assert_close(out, paged_triton.paged(c.q, c.layer_kv, c.step, c.scaling))
    torch.testing.assert_close(out, attention_plan.reference(c), rtol=FLOAT32, atol=FLOAT32)


def test_a_wrong_block_table_or_length_is_seen(paged_triton):
    """The comparisons above can fail: the reference sees a step whose blocks or lengths differ."""
    c = case([(1, 40), (1, 70), (5, 33)], 8, 2, 32, torch.float32)
    assert relative_error(paged_triton, c) < FLOAT32
    c.step.seqused_k[1] -= 1
    want = attention_plan.reference(c)
    c.step.seqused_k[1] += 1
    assert not torch.allclose(paged_triton.paged(c.q, c.layer_kv, c.step, c.scaling), want, atol=1e-3)
    c.step.kv_blocks[[0, 3]] = c.step.kv_blocks[[3, 0]]
    c2 = attention_plan.Case(c.q, c.layer_kv, c.step, c.scaling)
    got = paged_triton.paged(c.q, c.layer_kv, c.step, c.scaling)
    torch.testing.assert_close(got, attention_plan.reference(c2), rtol=FLOAT32, atol=FLOAT32)  # follows the table


def test_the_start_up_probe_passes_it_and_catches_a_wrong_kernel(paged_triton):
    assert attention_plan.kernel_fails(paged_triton.paged, DEVICE, torch.float16, 9, 3, 64) is None

    def off_by_one(q, layer_kv, step, scaling):
        step.seqused_k -= 1
        try:
            return paged_triton.paged(q, layer_kv, step, scaling)
        finally:
            step.seqused_k += 1

    assert "off the reference" in attention_plan.kernel_fails(off_by_one, DEVICE, torch.float16, 9, 3, 64)


def test_the_plan_on_the_cpu_is_sdpa_and_explicit_backends_are_refused():
    assert attention_plan.plan_varlen(CPU, torch.float32, 4, 2, 16) is None
    for backend in ("flash", "triton"):
        with pytest.raises(BadEngineSetting, match=f"--attention-backend {backend} needs CUDA in half precision"):
            attention_plan.plan_varlen(CPU, torch.float32, 4, 2, 16, backend=backend)
    with pytest.raises(BadEngineSetting, match="choose one of"):
        attention_plan.plan_varlen(CPU, torch.float32, 4, 2, 16, backend="xformers")


def test_engine_steps_through_it_make_the_sdpa_tokens(paged_triton):
    """The tiny Llama-shaped model, greedy, float32: the engine's steps (chunked prompts beside decodes, then
    decodes) attend through the paged kernel for both kinds of step, and make the tokens the SDPA paths make."""
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU, tests/test_engine_cuda.py runs the engine through it")
    rng = random.Random(0)
    prompts = [[rng.randrange(2048) for _ in range(n)] for n in (5, 30, 70, 17)]
    calls = []

    def paged(engine):
        counted = lambda q, *rest: calls.append(q.shape[0]) or paged_triton.paged(q, *rest)  # noqa: E731
        engine.runner.kernels = attention.VarlenKernels(decodes=counted, mixed=counted)
        engine.runner.varlen = True

    assert greedy_tokens(prompts, 12, paged) == greedy_tokens(prompts, 12)
    assert any(n > 1 for n in calls) and any(n == len(prompts) for n in calls)  # chunks and decode-only steps


def test_auto_takes_the_faster_kernel_for_each_kind_of_step(monkeypatch, caplog):
    """The start-up choice (attention_plan.choose), with stand-in times in place of the GPU's: every kernel and
    every decode tile is checked against the reference, each kind of step takes the fastest, the log says so; a
    kernel that fails its check is left out under auto and refused when asked for."""
    from enginecore.paged_triton import DECODE_TILES

    if DEVICE.type == "cpu":  # flash itself needs CUDA (and its reference cannot be captured in a CUDA graph)
        monkeypatch.setattr(attention, "flash_varlen", attention.varlen_reference)
    shapes = (DEVICE, torch.float16, 8, 2, 32)

    def stand_in_time(kernel, case):  # flash fastest on steps with prompt tokens, paged's second tile on decodes
        tile = getattr(kernel, "decode_tile", None)
        if case.step.max_q > 1:
            return 1.0 if tile is None else 2.0
        return {None: 3.0, DECODE_TILES[0]: 2.0, DECODE_TILES[1]: 1.0}.get(tile, 4.0)

    monkeypatch.setattr(attention_plan, "time_kernel", stand_in_time)
    with caplog.at_level("INFO", logger="enginecore.attention_plan"):
        kernels = attention_plan.choose(shapes, "auto", max_num_seqs=8)
    assert kernels.mixed is attention.gathered_flash
    assert kernels.decodes.decode_tile == DECODE_TILES[1]
    assert attention_plan.describe(kernels) == ("paged Triton (32 keys x 4 warps x 2 stages on decodes) for "
                                                "decode-only steps, gather + flash for steps with prompt tokens")
    decode_line = next(r.getMessage() for r in caplog.records if "for decode-only steps" in r.getMessage())
    assert "a layer of 8 runs" in decode_line and "gather + flash 3000.0 us" in decode_line
    assert decode_line.count("paged Triton") == 1 + len(DECODE_TILES)  # the choice, then each tile's time

    real_check = attention_plan.kernel_fails
    monkeypatch.setattr(attention_plan, "kernel_fails", lambda kernel, *shapes: (
        "broken" if getattr(kernel, "decode_tile", None) is None else real_check(kernel, *shapes)))
    kernels = attention_plan.choose(shapes, "auto", max_num_seqs=8)
    assert kernels.mixed.decode_tile == DECODE_TILES[0] and kernels.decodes.decode_tile == DECODE_TILES[1]
    with pytest.raises(BadEngineSetting, match=r"--attention-backend flash: gather \+ flash attention does not run "
                                               r"here \(broken\)"):
        attention_plan.choose(shapes, "flash", max_num_seqs=8)


def test_random_steps_match_the_reference(paged_triton):
    """Random steps: head shapes, block sizes, and runs of every kind mixed (decodes, chunks after cached context,
    fresh prompts, runs of one token with one key), decode-only ones (which may split) included."""
    rng = random.Random(7)
    for trial in range(12):
        kv_heads, group, head_dim = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4, 7]), rng.choice([16, 32, 40])
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        runs = []
        for _ in range(rng.randrange(1, 9)):
            kind = rng.choice(["decode", "decode", "chunk", "fresh"]) if trial % 3 else "decode"
            context = rng.randrange(1, 600)
            new = 1 if kind == "decode" else context if kind == "fresh" else rng.randrange(1, context + 1)
            runs.append((new, context))
        c = case(runs, group * kv_heads, kv_heads, head_dim, torch.float32, block_size=block_size, seed=trial)
        assert relative_error(paged_triton, c) < FLOAT32, (trial, runs, block_size, group, kv_heads, head_dim)
