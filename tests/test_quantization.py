"""--quantization on the CPU: what a user gives up against float32 on a fixed prompt set, and the default."""
import pytest
import torch
from enginecore.cpu_linear import FLOAT32_LINEARS, Bf16Linear, Int8Linear
from enginecore.cpu_setup import KERNELS, auto_choice, float32_layout, resolve_quantization
from enginecore.loader import BadEngineSetting

from tests.agreement import QUESTIONS, agreement, reference
from tests.test_engine_support import chat_prompt, make_engine

# Bounds against float32 (issue 16), for every mode `auto` may choose: the most likely token is float32's
# greedy token on >= 90% of positions (float32's continuation fed back, so one early difference does not shift
# every later position), and no prompt's mean per-token loglikelihood of that continuation moves by more than
# MAX_LOGPROB_GAP nats. Measured on an AMD EPYC (Zen 5): bf16 99.6% and 0.005; int8 90.2% and 0.11.
MIN_GREEDY_AGREEMENT = 0.90
MAX_LOGPROB_GAP = 0.15


@pytest.fixture(scope="module")
def float32_reference():
    return reference(make_engine(), [chat_prompt(q) for q in QUESTIONS], max_tokens=32)


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_quantized_modes_keep_float32_greedy_tokens_and_loglikelihoods(mode, float32_reference):
    a = agreement(float32_reference, make_engine(quantization=mode))
    assert a.positions == 32 * len(QUESTIONS)
    assert a.teacher_forced >= MIN_GREEDY_AGREEMENT, a
    assert a.max_prompt_logprob_gap <= MAX_LOGPROB_GAP, a
    assert a.teacher_forced < 1.0 or a.max_prompt_logprob_gap > 0, "the mode changed nothing: is it applied?"


@pytest.mark.parametrize("mode, kernel", [("bf16", Bf16Linear), ("int8", Int8Linear)])
def test_each_mode_multiplies_with_its_kernel(mode, kernel):
    engine = make_engine(quantization=mode)
    lean = engine.runner.lean_model
    assert all(isinstance(k, kernel) for layer in lean.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # bf16 logits come from a float32 head: bfloat16 inputs to it flipped float32's near-tie top tokens.
    assert isinstance(lean.head, FLOAT32_LINEARS if mode == "bf16" else kernel)
    assert engine.quantization == mode


def test_auto_chooses_by_measurement_for_the_embedded_gguf_and_float_elsewhere():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("auto", None, cpu, f32) == "auto"  # the embedded model (a GGUF): measured
    assert resolve_quantization("auto", "/models/x.gguf", cpu, f32) == "auto"
    assert resolve_quantization("auto", "/models/some-hf-dir", cpu, f32) == "none"
    assert resolve_quantization("auto", None, cpu, torch.bfloat16) == "none"
    engine = make_engine(quantization="auto")
    model = engine.loaded.model
    chosen, why = auto_choice(model, float32_layout(model))
    assert engine.quantization == chosen and "ms" in why
    expected = KERNELS.get(chosen, FLOAT32_LINEARS)
    assert isinstance(engine.runner.lean_model.layers[0].qkv, expected)
    assert isinstance(make_engine().runner.lean_model.layers[0].qkv, FLOAT32_LINEARS)  # the tests' float32 pin


@pytest.mark.parametrize("spec, device, dtype", [("int8", "cuda", torch.float32), ("bf16", "cpu", torch.bfloat16),
                                                 ("int4", "cpu", torch.float32)])
def test_impossible_quantizations_are_refused(spec, device, dtype):
    with pytest.raises(BadEngineSetting):
        resolve_quantization(spec, None, torch.device(device), dtype)


@pytest.mark.parametrize("kernel, tolerance", [(Int8Linear, 0.03), (Bf16Linear, 0.02)])
def test_quantized_product_is_close_to_float32(kernel, tolerance):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen) * 0.05
    x = torch.randn(5, 64, generator=gen)
    residual = torch.randn(5, 96, generator=gen)
    exact = x @ w.T + residual
    got = kernel(w)(x, residual=residual)
    assert (got - exact).abs().max() <= tolerance * (x @ w.T).abs().max()
    assert not torch.equal(got, exact)  # it really is quantized
