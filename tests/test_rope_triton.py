"""enginecore.rope_triton: RoPE and the K/V cache write in one Triton kernel (compiled on a CUDA GPU, else through
Triton's interpreter, tests/triton_setup.py). It must give exactly what the lean forward's torch ops and attention's
cache write give, and the engine's steps through it must make the same tokens."""
import random

import pytest
import torch

from enginecore import attention, attention_plan
from tests.tiny_engine import greedy_tokens
from tests.triton_setup import DEVICE, HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="no Triton (the test extra installs it)")


@pytest.fixture(scope="module")
def rope_triton():
    from enginecore import rope_triton

    return rope_triton


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 16), (6, 2, 48)],
                         ids=["smollm2", "llama8b", "mha", "head-dim-48"])
# float32 only through the interpreter: on a GPU Triton may fuse its product and sum into one FMA (the engine uses
# the kernel in half precision only); bfloat16 only compiled: the interpreter computes it wrongly (NaN).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.float16, torch.bfloat16])
def test_same_values_as_the_torch_ops(rope_triton, heads, kv_heads, head_dim, dtype):
    """attention_plan.rope_store_fails compares q and both caches bit for bit on a step in random slots (and, on a
    GPU, replayed from a CUDA graph)."""
    assert attention_plan.rope_store_fails(DEVICE, dtype, heads, kv_heads, head_dim) is None


def test_only_the_steps_slots_change_and_a_wrong_rotation_is_seen(rope_triton, monkeypatch):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    heads, kv_heads, d, tokens = 8, 2, 32, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=DEVICE, generator=g)
    angles = torch.rand(tokens, 1, d, device=DEVICE, generator=g) * 6.3
    sin = angles.sin()
    sin_signed = torch.cat([-sin[..., :d // 2], sin[..., d // 2:]], dim=-1)
    slots = torch.tensor([7, 2, 30, 11, 19], device=DEVICE)
    k_cache, v_cache = (torch.randn(32, kv_heads, d, device=DEVICE, generator=g) for _ in range(2))
    k, v = k_cache.clone(), v_cache.clone()
    q = rope_triton.rope_store(qkv, angles.cos(), sin_signed, slots, k, v, heads, kv_heads)
    others = [i for i in range(32) if i not in slots.tolist()]
    assert torch.equal(k[others], k_cache[others]) and torch.equal(v[others], v_cache[others])
    assert torch.equal(v[slots], qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d))  # v as it came
    assert q.shape == (tokens, heads, d)
    # The check sees a rotation the other way (sin's sign flipped).
    monkeypatch.setattr(rope_triton, "rope", lambda qk, cos, sin_signed: qk * cos - qk.roll(qk.shape[-1] // 2, -1) * sin_signed)
    assert "its q differs" in attention_plan.rope_store_fails(DEVICE, torch.float32, 8, 2, 32)


def test_the_plan_keeps_torchs_ops_on_the_cpu():
    assert attention_plan.plan_rope_store(torch.device("cpu"), torch.float32, 4, 2, 16) is None


def test_engine_steps_through_it_make_the_sdpa_tokens(rope_triton):
    """The tiny Llama-shaped model, greedy, float32: with the paged kernel for every step and RoPE + the K/V
    write fused, the engine's steps (chunked prompts beside decodes, then decodes) make the SDPA paths' tokens."""
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU, tests/test_engine_cuda.py runs the engine through it")
    from enginecore.paged_triton import paged

    rng = random.Random(3)
    prompts = [[rng.randrange(2048) for _ in range(n)] for n in (9, 40, 3, 66)]
    calls = []

    def fused(engine):
        engine.runner.kernels, engine.runner.varlen = attention.VarlenKernels(decodes=paged, mixed=paged), True

        def counted(qkv, *rest):
            calls.append(qkv.shape[0])
            return rope_triton.rope_store(qkv, *rest)

        engine.runner.lean_model.rope_store = counted

    assert greedy_tokens(prompts, 10, fused) == greedy_tokens(prompts, 10)
    assert any(n > 1 for n in calls) and any(n == len(prompts) for n in calls)  # chunks and decode-only steps
