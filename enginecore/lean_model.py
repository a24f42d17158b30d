"""A lean forward pass for Llama-architecture models (SmolLM2, Llama, and models shaped like them), on the CPU and
on CUDA.

Why: transformers' Llama layer issues about a hundred ops (separate q/k/v and gate/up products, RoPE through
slices and a concatenation, a norm of six ops, the views around them) and as many Python module calls. On the
CPU, at one stream on 2 cores, those cost about as much as the products, and every op that opens an OpenMP region
is a chance for a descheduled thread to stall the step. On a GPU each op is a kernel: in a CUDA graph's decode
step of SmolLM2-135M at 256 sequences (H200) the small elementwise kernels took about as long as the products.
This forward reads the same weights from the transformers model and computes the same function in about twenty
ops a layer:

- q, k and v in one product (their weights concatenated), gate and up in one, the residual adds inside the
  o and down products (addmm), RoPE on q and k together in four ops, one rms_norm op per norm;
- attention through the engine's paged attention (enginecore.attention), unchanged; on CUDA, where a step attends
  in one varlen call and the Triton kernel checks out exact, RoPE and the K/V cache write are one kernel
  (enginecore.rope_triton, `rope_store`) instead of the four RoPE ops and attention's two cache copies;
- the final norm and the LM head only on the rows whose logits are wanted.

Where a product keeps its concatenated weight as it is (torch's own product: always on CUDA, row-major float32 on
the CPU), the transformers modules' q/k/v and gate/up weights become views of it, so the model is not held twice.

Float32 results equal transformers' up to the order of additions inside the products (greedy tokens are
checked against plain transformers by tests/test_engine_correctness.py on the CPU and tests/test_engine_cuda.py
on CUDA). The products are `LinearKernel`s (enginecore.cpu_linear): on the CPU float32 in the layout picked for
this CPU, or int8 or bfloat16; on CUDA torch's own (cuBLAS) in the model's dtype.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from enginecore import attention
from enginecore.cpu_linear import LinearKernel, TorchLinear

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10  # how often a long preparation of the weights says how far it got

LinearFactory = Callable[[torch.Tensor], LinearKernel]  # a float [out, in] weight -> the kernel that multiplies by it


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when `model` is a Llama-architecture model this forward computes exactly; else why not."""
    config = model.config
    if config.model_type != "llama":
        return f"model type {config.model_type} (the lean forward covers llama)"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in attention or MLP"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    return None


def device_lean_model(model: torch.nn.Module) -> LeanLlama | None:
    """The lean forward on a GPU, with torch's own products in the model's dtype; None where transformers'
    forward runs (a model this forward does not cover)."""
    why_not = unsupported_reason(model)
    if why_not:
        log.info("transformers' forward (%s)", why_not)
        return None
    log.info("lean Llama forward, torch's products in %s", str(model.dtype).removeprefix("torch."))
    return LeanLlama(model, TorchLinear)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """q and k heads [T, heads, d] rotated: transformers' x * cos + rotate_half(x) * sin, where sin_signed has its
    first half negated so that rotate_half(x) * sin is x rolled by half a head times it (no concatenation)."""
    return qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin_signed


@torch.no_grad()
def _fused(make_linear: LinearFactory, modules: list[torch.nn.Linear]) -> LinearKernel:
    """One product for several Linears of the same input: their weights stacked. Where the kernel keeps the
    stacked weight as it is, the modules' weights become views of it (one copy of the model, not two)."""
    weight = torch.cat([m.weight for m in modules])
    linear = make_linear(weight)
    if getattr(linear, "weight", None) is weight:
        at = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[at:at + rows]
            at += rows
    return linear


@dataclass
class _Layer:
    layer_idx: int  # what paged_attention reads from its `module` argument
    input_norm: torch.Tensor
    qkv: LinearKernel
    o: LinearKernel
    post_norm: torch.Tensor
    gate_up: LinearKernel
    down: LinearKernel


class LeanLlama:
    def __init__(self, model: torch.nn.Module, make_linear: LinearFactory, make_head: LinearFactory | None = None):
        base = model.model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb  # transformers' own cos/sin (every RoPE scaling type it knows)
        self.final_norm = base.norm.weight
        self.scaling = base.layers[0].self_attn.scaling
        self.layers = self._layers(base.layers, make_linear)
        self.head = (make_head or make_linear)(model.lm_head.weight)
        # enginecore.rope_triton.rope_store where the engine found it exact here (CUDA): RoPE and the K/V cache
        # write in one kernel, for steps that attend in one varlen call.
        self.rope_store: Callable | None = None
        # On the CPU: the small ops by our C kernels (enginecore.cpu_layer_ops), where they build; and a decode
        # step's layers in one C call where the products are all our int8 kernel's (enginecore.cpu_decode_layers).
        self.cpu_ops = None
        self.cpu_decode_layers = None

    def _layers(self, layers, make_linear: LinearFactory) -> list[_Layer]:
        """Each decoder layer's weights made over for its kernel, with progress in the log: packing a large model
        for the CPU's kernels takes a while (an 8B model's weights, a minute or more on a few cores)."""
        started = said = time.monotonic()
        out = []
        for index, layer in enumerate(layers):
            out.append(self._layer(index, layer, make_linear))
            if time.monotonic() - said >= PROGRESS_EVERY_S and index + 1 < len(layers):
                said = time.monotonic()
                log.info("the products' weights: %d of %d layers made ready (%.0f s)", index + 1, len(layers),
                         said - started)
        if time.monotonic() - started >= PROGRESS_EVERY_S:
            log.info("the products' weights of %d layers made ready in %.1f s", len(layers), time.monotonic() - started)
        return out

    @staticmethod
    def _layer(index: int, layer, make_linear: LinearFactory) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        return _Layer(
            layer_idx=index,
            input_norm=layer.input_layernorm.weight,
            qkv=_fused(make_linear, [a.q_proj, a.k_proj, a.v_proj]),
            o=make_linear(a.o_proj.weight),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=_fused(make_linear, [m.gate_proj, m.up_proj]),
            down=make_linear(m.down_proj.weight),
        )

    def linears(self) -> list[LinearKernel]:
        return [k for layer in self.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> logits [len(sample_rows), vocab]; attention.current is set by the caller."""
        return self.logits(self.hidden(input_ids, positions), sample_rows)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> the last layer's output [T, hidden] (before the final norm). Split from the
        head so that a CUDA graph can hold the layers of a step whose sampled rows vary (enginecore.cuda_graphs)."""
        h = F.embedding(input_ids, self.embed)
        cos, sin_signed = self._rope_tables(h, positions)
        step, cache = attention.current.step, attention.current.kv_cache
        if self.cpu_decode_layers is not None and self.cpu_decode_layers.applies(step, cache, h.shape[0]):
            return self.cpu_decode_layers(h, cos, sin_signed, step, cache)
        for layer in self.layers:
            h = self._layer_forward(layer, h, cos, sin_signed)
        return h

    def logits(self, h: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head on the rows `sample_rows` of `hidden`'s output."""
        return self.head(self._norm(h.index_select(0, sample_rows), self.final_norm))

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.cpu_ops.rms_norm(h, weight, self.eps)
        return torch.rms_norm(h, (h.shape[1],), weight, self.eps)

    def _rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, d] for the step; sin with its first half negated, so that rotate_half(x) * sin
        (transformers' formula) is x rolled by half a head times it: the same products, without the concatenation
        of two slices per tensor."""
        cos, sin = self.rotary(h, positions[None])
        half = self.head_dim // 2
        sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return cos[0, :, None, :].contiguous(), sin_signed[:, None, :]

    def _layer_forward(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        tokens = h.shape[0]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(self._norm(h, layer.input_norm))
        step, cache = attention.current.step, attention.current.kv_cache
        if self.rope_store is not None and step is not None and step.varlen is not None and cache is not None:
            k_slots, v_slots = cache.slots[layer.layer_idx]
            q = self.rope_store(qkv, cos, sin_signed, step.slot_mapping, k_slots, v_slots, heads, kv_heads)
            out = attention.attend_stored(layer.layer_idx, q, self.scaling)
        elif self.cpu_ops is not None and step is not None and step.varlen is None and cache is not None:
            k_slots, v_slots = cache.slots[layer.layer_idx]
            q = self.cpu_ops.rope_store(qkv, cos, sin_signed, step.slot_mapping, k_slots, v_slots, heads, kv_heads)
            out = attention.attend_written(layer.layer_idx, q, self.scaling)
        else:
            qk = rope(qkv[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos, sin_signed)
            v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
            # paged_attention takes transformers' [1, heads, T, d] views and returns [1, T, heads, d].
            out, _ = attention.paged_attention(layer, qk[:, :heads].transpose(0, 1)[None],
                                               qk[:, heads:].transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               scaling=self.scaling)
        h = layer.o(out.reshape(tokens, heads * d), residual=h)
        gate_up = layer.gate_up(self._norm(h, layer.post_norm))
        if self.cpu_ops is not None:
            act = self.cpu_ops.silu_mul(gate_up)
        else:
            act = F.silu(gate_up[:, :self.intermediate]).mul_(gate_up[:, self.intermediate:])
        return layer.down(act, residual=h)
