"""The inputs of the varlen step (enginecore.step_inputs with varlen=True), checked on any machine: a step described
for it must attend exactly as the SDPA paths (varlen=False) do, in float32 on the CPU, through either kernel of
varlen steps. Flash attention itself needs CUDA, so for gather + flash attention.flash_varlen is replaced by
attention.varlen_reference (the same call in plain torch, SDPA run by run); the paged Triton kernel runs through
Triton's interpreter (tests/triton_setup.py). tests/test_engine_cuda.py checks the real kernels against the same
SDPA paths."""
from types import SimpleNamespace

import pytest
import torch

from enginecore import attention
from enginecore.kv_cache import KVCache, KVShape
from enginecore.sequence import Sequence
from enginecore.step_inputs import DecodePadding, MixedPadding, build_step_inputs
from ipc.sampling import SamplingParams
from tests.triton_setup import DEVICE, HAVE_TRITON

BLOCK = 4  # small blocks: short contexts still span several, most of them partly filled
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
NUM_BLOCKS = 64
CPU = torch.device("cpu")


@pytest.fixture(params=["gather-flash", "paged-triton"])
def cache(monkeypatch, request):
    monkeypatch.setattr(attention, "flash_varlen", attention.varlen_reference)
    if request.param == "paged-triton":
        if not HAVE_TRITON or DEVICE.type != "cpu":
            pytest.skip("no Triton" if not HAVE_TRITON else "on a GPU, tests/test_engine_cuda.py runs these cases")
        from enginecore.paged_triton import paged

        monkeypatch.setattr(attention.current, "kernels", attention.VarlenKernels(decodes=paged, mixed=paged))
    g = torch.Generator().manual_seed(0)
    kv = KVCache(KVShape(1, KV_HEADS, HEAD_DIM), NUM_BLOCKS, BLOCK, torch.float32, CPU)
    kv.tensor.normal_(generator=g)  # every slot distinct, the scratch block too
    attention.current.kv_cache = kv
    yield kv
    attention.current.kv_cache = None
    attention.current.step = None


class Blocks:
    """Hands out the cache's blocks in a random order, so that runs' blocks interleave."""

    def __init__(self):
        self.free = iter(torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist())

    def seq(self, computed: int, total: int) -> Sequence:
        """A sequence of `total` tokens, `computed` of them in the cache."""
        return Sequence(seq_id=0, request_id="x", client=None, index=0, token_ids=[0] * total,
                        num_prompt_tokens=total, sampling=SamplingParams(), priority=0, arrival=0,
                        num_computed_tokens=computed, block_table=[next(self.free) for _ in range(-(-total // BLOCK))])


def qkv(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g), torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g),
            torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g))


def attend(step: attention.StepAttention, q, k, v) -> torch.Tensor:
    attention.current.step = step
    out, _ = attention.paged_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=HEAD_DIM ** -0.5)
    return out[0]


def both(entries, padding: DecodePadding | None = None):
    """The step described for flash varlen and for the SDPA paths."""
    varlen = build_step_inputs(entries, BLOCK, CPU, padding, varlen=True).attention
    sdpa = build_step_inputs(entries, BLOCK, CPU, padding, varlen=False).attention
    assert varlen.varlen is not None and sdpa.varlen is None
    return varlen, sdpa


def test_varlen_inputs_are_whole_blocks_and_real_lengths(cache):
    blocks = Blocks()
    decode, prompt, chunk = blocks.seq(9, 10), blocks.seq(0, 7), blocks.seq(5, 13)
    v = build_step_inputs([(decode, 1), (prompt, 7), (chunk, 4)], BLOCK, CPU, varlen=True).attention.varlen
    assert v.kv_blocks.tolist() == decode.block_table[:3] + prompt.block_table[:2] + chunk.block_table[:3]
    assert v.cu_q.tolist() == [0, 1, 8, 12]
    assert v.cu_k.tolist() == [0, 12, 20, 32]  # 3, 2 and 3 whole blocks
    assert v.seqused_k.tolist() == [10, 7, 9]
    assert (v.max_q, v.max_k) == (7, 12)
    assert v.cu_q.dtype == v.cu_k.dtype == v.seqused_k.dtype == torch.int32


def test_mixed_step_attends_as_sdpa_paths(cache):
    """Decodes (a context of one token, one that fills its last block, one that does not), a fresh prompt, a
    chunk after cached context starting on a block boundary, one starting and ending inside blocks."""
    blocks = Blocks()
    entries = [(blocks.seq(9, 10), 1), (blocks.seq(11, 12), 1), (blocks.seq(0, 1), 1),
               (blocks.seq(0, 7), 7), (blocks.seq(8, 14), 6), (blocks.seq(5, 13), 4), (blocks.seq(0, 21), 21)]
    varlen, sdpa = both(entries)
    q, k, v = qkv(sum(n for _, n in entries), seed=2)
    want = attend(sdpa, q, k, v)
    torch.testing.assert_close(attend(varlen, q, k, v), want)

    # The comparison sees a context one token too long, and two runs' blocks exchanged.
    varlen.varlen.seqused_k[0] += 1
    assert not torch.allclose(attend(varlen, q, k, v), want)
    varlen.varlen.seqused_k[0] -= 1
    kv_blocks = varlen.varlen.kv_blocks
    kv_blocks[[0, -1]] = kv_blocks[[-1, 0]]
    assert not torch.allclose(attend(varlen, q, k, v), want)


def test_padded_decode_bucket_attends_as_sdpa_paths(cache):
    """A CUDA graph's decode step: 5 sequences padded to 8 rows of 6 blocks each; padding rows look at the scratch
    block."""
    blocks = Blocks()
    entries = [(blocks.seq(c - 1, c), 1) for c in (1, 4, 10, 17, 24)]
    padding = DecodePadding(batch=8, blocks=6, scratch_block=cache.scratch_block)
    varlen, sdpa = both(entries, padding)
    v = varlen.varlen
    assert v.kv_blocks.shape == (8 * 6,) and v.cu_k.tolist() == [i * 6 * BLOCK for i in range(9)]
    assert v.seqused_k.tolist() == [1, 4, 10, 17, 24, 1, 1, 1]
    table = v.kv_blocks.view(8, 6).tolist()
    for row, (seq, _) in enumerate(entries):
        used = -(-seq.num_tokens // BLOCK)
        assert table[row] == seq.block_table[:used] + [cache.scratch_block] * (6 - used)
    assert table[5:] == [[cache.scratch_block] * 6] * 3
    q, k, vv = qkv(8, seed=3)
    want = attend(sdpa, q, k, vv)
    torch.testing.assert_close(attend(varlen, q, k, vv), want)

    v.seqused_k[2] -= 1
    assert not torch.allclose(attend(varlen, q, k, vv), want)
    v.seqused_k[2] += 1
    v.kv_blocks[[6, 12]] = v.kv_blocks[[12, 6]]  # the first blocks of rows 1 and 2
    assert not torch.allclose(attend(varlen, q, k, vv), want)


def test_mixed_step_padded_for_a_graph_attends_as_sdpa_paths(cache):
    """A CUDA graph's step with prompt tokens: the mix above padded to 48 tokens, 10 runs and 40 blocks. The real
    rows attend as unpadded; the padding rows only write to the scratch block."""
    blocks = Blocks()
    entries = [(blocks.seq(9, 10), 1), (blocks.seq(11, 12), 1), (blocks.seq(0, 1), 1),
               (blocks.seq(0, 7), 7), (blocks.seq(8, 14), 6), (blocks.seq(5, 13), 4), (blocks.seq(0, 21), 21)]
    tokens = sum(n for _, n in entries)
    padding = MixedPadding(tokens=48, runs=10, blocks=40, scratch_block=cache.scratch_block)
    varlen = build_step_inputs(entries, BLOCK, CPU, padding, varlen=True).attention
    sdpa = build_step_inputs(entries, BLOCK, CPU, varlen=False).attention
    q, k, v = qkv(48, seed=4)
    want = attend(sdpa, q[:, :, :tokens], k[:, :, :tokens], v[:, :, :tokens])
    before = cache.tensor.clone()
    got = attend(varlen, q, k, v)[:tokens]
    torch.testing.assert_close(got, want)
    changed = (cache.tensor != before).flatten(3).any(-1)  # [layers, K/V, blocks] that the padded step wrote
    assert changed.nonzero()[:, 2].unique().tolist() == [cache.scratch_block]

    varlen.varlen.cu_q[4] += 1  # one query moved from the fresh prompt to the next chunk
    assert not torch.allclose(attend(varlen, q, k, v)[:tokens], want)
