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


def test_a_long_preparation_of_the_weights_says_how_far_it_got(monkeypatch, caplog):
    """Packing a large model's weights for the CPU's kernels takes a minute or more: the log says how far it got
    every PROGRESS_EVERY_S, and how long it took."""
    import logging

    from enginecore import lean_model

    monkeypatch.setattr(lean_model, "PROGRESS_EVERY_S", 0)
    model = loaded_model().model
    with caplog.at_level(logging.INFO, logger="enginecore.lean_model"):
        lean = lean_model.LeanLlama(model, TorchLinear)
    layers = len(lean.layers)
    messages = [record.getMessage() for record in caplog.records]
    assert f"the products' weights: 1 of {layers} layers made ready" in messages[0]
    assert sum(f"of {layers} layers made ready (" in m for m in messages) == layers - 1
    assert messages[-1].startswith(f"the products' weights of {layers} layers made ready in ")
