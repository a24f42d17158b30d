"""The lean Llama forward as CUDA builds it (torch's own products on the stacked weights), run here on the CPU:
greedy tokens equal plain transformers', and the transformers modules' q/k/v and gate/up weights become views of
the stacked weights instead of a second copy of the model."""
from enginecore.cpu_linear import TorchLinear
from enginecore.lean_model import device_lean_model
from tests.test_engine_support import (  # noqa: F401
    greedy_request, loaded_model, make_engine, prompts, reference_greedy,
)


def test_device_lean_model_matches_transformers_and_shares_the_weights(prompts):
    engine = make_engine()
    model = loaded_model().model
    lean = device_lean_model(model)
    assert lean is not None and isinstance(lean.layers[0].qkv, TorchLinear)
    engine.runner.lean_model = lean
    out = engine.generate([greedy_request(f"r{i}", p, 16) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[(f"r{i}", 0)] == reference_greedy(p, 16)
    attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    stacked = lean.layers[3].qkv.weight
    assert attn.q_proj.weight.data_ptr() == stacked.data_ptr()
    assert attn.v_proj.weight.data_ptr() == stacked[-attn.v_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == lean.layers[3].gate_up.weight[mlp.gate_proj.weight.shape[0]:].data_ptr()
