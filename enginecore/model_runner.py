"""ModelRunner: one forward pass of the transformers model over a packed step, logits for the rows sampled.

The model's attention is switched to the engine's paged attention (enginecore.attention); the model runs with
use_cache=False because the engine owns the KV cache.
"""
from __future__ import annotations

import logging

import torch

from enginecore import attention
from enginecore.kv_cache import KVCache
from enginecore.step_inputs import StepInputs

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache | None = None):
        self.model = model
        self.kv_cache = kv_cache
        attention.register()
        try:
            model.set_attn_implementation(attention.ATTENTION_NAME)
        except Exception as exc:  # a model class that does not go through the AttentionInterface
            raise RuntimeError(f"{type(model).__name__} cannot use the engine's paged attention: {exc}") from exc
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            raise RuntimeError(f"{type(model).__name__} does not support a pluggable attention implementation")

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """[number of sampled rows, vocab] logits."""
        attention.current.step = inputs.attention
        attention.current.kv_cache = self.kv_cache
        try:
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                use_cache=False,
                logits_to_keep=inputs.sample_rows,
            )
        finally:
            attention.current.step = None
        return out.logits[0]
