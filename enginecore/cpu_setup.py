"""Everything the engine decides once at start-up to run a model on the CPU: the quantization, the products'
kernels and layout (by measurement on this CPU), and whether the lean Llama forward applies.

`--quantization` (vLLM's flag) on the CPU, the activations and everything but the matrix products in float32:
- `none`: float32 weights (in the layout measured faster here);
- `bf16`: bfloat16 weights and product inputs (enginecore.cpu_linear.Bf16Linear), the LM head in float32;
- `int8`: 8-bit weights by one of two kernels, timed at start-up on the model's products: our own W8A32
  (enginecore.cpu_int8: codes per block of 32 columns with a scale and an offset, which hold a GGUF's weights
  exactly; float32 activations; any CPU with a C compiler), or oneDNN's W8A8 (Int8Linear: one scale per output
  channel, activations quantized per token; right only where the CPU has VNNI) where that takes under 0.7 of our
  time;
- `auto`, the default: for a model loaded from a GGUF (the embedded model is one: its weights are 4-bit
  quantized already), the most accurate mode that beats float32 on the model's products at start-up (choose_auto):
  int8 by our kernel, which keeps such a model's weights exactly; else bf16 where the CPU multiplies bfloat16
  natively; else oneDNN's int8; else none (tests/test_quantization.py bounds each against float32; README gives
  the figures). For any other model, and on CUDA, auto is none: its user asked for those weights.
"""
from __future__ import annotations

import logging
import weakref
from typing import Callable, cast

import torch

from enginecore import cpu_attention, weight_pages
from enginecore.cpu_int8 import PackedInt8Linear, packed_int8_unavailable_reason, packed_summary
from enginecore.cpu_decode_layers import CpuDecodeLayers
from enginecore.cpu_layer_ops import layer_ops
from enginecore.cpu_linear import (FLOAT32_KERNELS, Bf16Linear, Int8Linear, bf16_unavailable_reason, native_bf16,
                                   onednn_int8_unavailable_reason, pick_float32_layout, time_kernels)
from enginecore.lean_model import LeanLlama, unsupported_reason
from enginecore.cpu_weights import store_linear_weights_column_major
from enginecore.engine_base import BadEngineSetting

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "bf16", "int8")
# oneDNN's W8A8 takes the int8 products only where it times at most this share of ours.
ONEDNN_INT8_MARGIN = 0.7
# --quantization int8's kernels, by the name the log gives them.
INT8_KERNELS = {"W8A32 (ours)": (PackedInt8Linear, packed_int8_unavailable_reason),
                "W8A8 (oneDNN)": (Int8Linear, onednn_int8_unavailable_reason)}

# Built CPU models per transformers model and choice: engines built on one loaded model (tests, benchmarks)
# share the copies instead of making their own.
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_quantization(spec: str, model_spec: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The mode asked for, checked; `auto` stays `auto` where the CPU must choose by measurement (the model's
    shapes are needed: see prepare_cpu_model), else becomes `none`."""
    if spec not in QUANTIZATIONS:
        raise BadEngineSetting(f"--quantization {spec}: expected one of {', '.join(QUANTIZATIONS)}")
    if spec == "auto":
        from_gguf = model_spec is None or model_spec.endswith(".gguf")
        return "auto" if device.type == "cpu" and dtype == torch.float32 and from_gguf else "none"
    if spec != "none" and device.type != "cpu":
        raise BadEngineSetting(f"--quantization {spec} runs on the CPU only")
    if spec != "none" and dtype != torch.float32:
        raise BadEngineSetting(f"--quantization {spec} keeps float32 activations: use --dtype float32 (or auto)")
    return spec


def int8_kernels() -> dict:
    """--quantization int8's kernels that multiply right here, by name."""
    return {name: kernel for name, (kernel, unavailable) in INT8_KERNELS.items() if unavailable() is None}


def int8_unavailable_reason() -> str | None:
    """Why neither int8 kernel runs here, or None."""
    if int8_kernels():
        return None
    return "; ".join(unavailable() or "" for _, unavailable in INT8_KERNELS.values())


def choose_auto(model: torch.nn.Module, layout: dict) -> tuple[str, str]:
    """(mode, why) for --quantization auto (a GGUF model): the most accurate mode that beats float32's products by
    10% here. Our int8 kernel first: its blocks hold a GGUF's weights exactly (bench/quantization.py: float32's
    greedy tokens at 100% of the positions); then bf16 (99.6%); then oneDNN's W8A8 (90.2%)."""
    candidates = {"none": FLOAT32_KERNELS[layout["kernel"]]}
    if native_bf16():
        candidates["bf16"] = Bf16Linear
    if int8_kernels():
        candidates["int8"] = INT8_KERNELS[int8_kernel(model)["kernel"]][0]
    if len(candidates) == 1:
        return "none", f"no native bfloat16 and no int8 kernel here ({int8_unavailable_reason()})"
    times = time_kernels(candidates, product_shapes(model), batch_sizes=(1, 8))
    why = "the model's products at batch 1 and 8 took " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
    exact_int8 = candidates.get("int8") is PackedInt8Linear
    for mode in ("int8", "bf16") if exact_int8 else ("bf16", "int8"):  # the more accurate first
        if mode in times and times[mode] < 0.9 * times["none"]:
            return mode, why
    return "none", why


def prepare_cpu_model(model: torch.nn.Module, dtype: torch.dtype, quantization: str) -> LeanLlama | None:
    """The lean CPU model for `model`, or None where transformers' forward runs (then, in float32, its Linear
    weights are re-laid in place in the layout measured faster here)."""
    why_not = unsupported_reason(model)
    if quantization == "auto" and why_not:
        quantization = "none"
    if quantization not in ("none", "auto"):
        if why_not:
            raise BadEngineSetting(f"--quantization {quantization} on the CPU needs a Llama-architecture model: "
                                   f"{why_not}")
        unavailable = {"int8": int8_unavailable_reason, "bf16": bf16_unavailable_reason}[quantization]()
        if unavailable:
            raise BadEngineSetting(f"--quantization {quantization}: {unavailable}; use --quantization none")
    if dtype != torch.float32:
        log.info("CPU: transformers' forward in %s (the lean forward and its kernel choice are float32)", dtype)
        return None
    # Built now, not by the first step with decode rows (a second or two of the compiler in the step loop). Both
    # forwards attend decode rows with it; the one-call decode step has its own copy.
    cpu_attention.kernel()
    if why_not:
        layout = float32_layout(model)
        if layout["column_major"]:
            store_linear_weights_column_major(model)
        log.info("CPU: transformers' forward (%s); float32 weights %s-major (%s)", why_not,
                 "column" if layout["column_major"] else "row", layout["why"])
        return None
    why = ""
    if quantization == "auto":
        quantization, why = auto_choice(model, float32_layout(model))
    # float32's kernels are timed only where a float32 product will run (bf16 keeps its LM head in float32).
    layout = float32_layout(model) if quantization in ("none", "bf16") else None
    kernel, described = mode_kernel(model, quantization, layout)
    key = (quantization, kernel)
    cached = _built.setdefault(model, {})
    if key not in cached:
        # bf16 keeps the LM head in float32: logits from bfloat16 inputs flipped near-ties of float32's top two
        # tokens (the README's own "capital of France?" began "L'Étoile" instead of "The capital ... Paris").
        cached[key] = LeanLlama(model, kernel, make_head=FLOAT32_KERNELS[layout["kernel"]]
                                if quantization == "bf16" else None)
        release_replaced_weights(model, cached[key])  # once, after the copies are made
    cached[key].quantization = quantization
    with_cpu_kernels(cached[key])
    if kernel is PackedInt8Linear:
        described += f"; {packed_summary(cached[key].linears())}"
    log.info("CPU: lean Llama forward, products %s%s", described, f"; --quantization auto chose {quantization}: {why}"
             if why else "")
    return cached[key]


# Kernels that multiply by a copy of their own (packed, converted or quantized), not by the model's weight itself.
OWN_COPY_KERNELS = (PackedInt8Linear, Bf16Linear, Int8Linear)


def release_replaced_weights(model: torch.nn.Module, lean: LeanLlama) -> None:
    """Give the operating system back the pages of the float32 weights that only a kernel's own copy is read for
    (enginecore.weight_pages): about 400 of the embedded model's 513 MB under int8. The embedding, which the lean
    forward looks rows up in, and a head multiplied in float32 (bf16's) stay."""
    weights: list[torch.Tensor] = []
    sources = cast(torch.nn.ModuleList, model.model.layers)  # (a Module attribute, to mypy any of three types)
    for source, layer in zip(sources, lean.layers):
        if all(isinstance(k, OWN_COPY_KERNELS) for k in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            a, m = source.self_attn, source.mlp
            weights += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.gate_proj.weight,
                        m.up_proj.weight, m.down_proj.weight]
    if isinstance(lean.head, OWN_COPY_KERNELS) and model.lm_head.weight.data_ptr() != lean.embed.data_ptr():
        weights.append(cast(torch.Tensor, model.lm_head.weight))
    released = weight_pages.release(weights)
    if released:
        log.info("CPU: %d MiB of float32 weights that the products' own copies replace dropped from memory (read "
                 "again from the model's file if ever needed)", released >> 20)


def with_cpu_kernels(lean: LeanLlama) -> LeanLlama:
    """`lean` with our C kernels of the layers' small ops, and its decode steps' layers in one C call, where they
    build and apply."""
    lean.cpu_ops = layer_ops()
    lean.cpu_decode_layers = CpuDecodeLayers.for_model(lean) if lean.cpu_ops else None
    return lean


def mode_kernel(model: torch.nn.Module, quantization: str, layout: dict | None) -> tuple[Callable, str]:
    """The kernel of a mode's products here, and how the log names it; `layout` (float32_layout) for none."""
    if quantization == "bf16":
        return Bf16Linear, "bfloat16 (oneDNN)"
    if quantization == "int8":
        int8 = int8_kernel(model)
        return INT8_KERNELS[int8["kernel"]][0], f"int8 {int8['kernel']}{' (' + int8['why'] + ')' if int8['why'] else ''}"
    assert layout is not None, "float32's products need float32_layout"
    return FLOAT32_KERNELS[layout["kernel"]], f"float32 {layout['kernel']} ({layout['why']})"


_auto: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def auto_choice(model: torch.nn.Module, layout: dict) -> tuple[str, str]:
    """choose_auto, measured once per model and process."""
    if model not in _auto:
        _auto[model] = choose_auto(model, layout)
    return _auto[model]


def product_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) of one layer's fused products and of the LM head, as the lean forward multiplies them."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    hidden, inter = c.hidden_size, c.intermediate_size
    return [(hidden, (heads + 2 * kv_heads) * d), (heads * d, hidden), (hidden, 2 * inter), (inter, hidden),
            (hidden, c.vocab_size)]


_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_int8: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def int8_kernel(model: torch.nn.Module) -> dict:
    """The int8 kernel for `model` here: `kernel`, its name in INT8_KERNELS; `why`, the timings where two ran.
    Measured once per model and process, on the model's product shapes at batch 1, 8 and 32."""
    if model not in _int8:
        kinds = int8_kernels()
        ours = packed_int8_unavailable_reason()
        if kinds and ours is not None:  # said where oneDNN's takes its place, as every kernel left out is said
            log.info("int8 products: our W8A32 kernel is left out: %s", ours)
        if len(kinds) == 1:
            _int8[model] = {"kernel": next(iter(kinds)), "why": ""}
        else:
            t = time_kernels(kinds, product_shapes(model))
            # Ours unless oneDNN's is clearly faster: its activations are quantized too, and it keeps float32's
            # greedy tokens less well (90.2% against 100% on bench/quantization.py's prompts).
            fast = "W8A8 (oneDNN)" if t["W8A8 (oneDNN)"] < ONEDNN_INT8_MARGIN * t["W8A32 (ours)"] else "W8A32 (ours)"
            _int8[model] = {"kernel": fast, "why": "timed at start-up: " + ", ".join(
                f"{name} {seconds * 1e3:.2f} ms" for name, seconds in t.items())}
    return _int8[model]


def float32_layout(model: torch.nn.Module) -> dict:
    """Measured once per model and process (a second engine on the same model keeps the first's choice)."""
    if model not in _layouts:
        try:
            shapes = product_shapes(model)
        except AttributeError:  # not a config with the usual names: time a generic square product
            shapes = [(model.config.hidden_size, model.config.hidden_size)]
        _layouts[model] = pick_float32_layout(shapes)
    return _layouts[model]
