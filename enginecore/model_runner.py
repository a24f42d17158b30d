"""ModelRunner: one forward pass of the transformers model over a packed step, logits for the rows sampled.

The model's attention is switched to the engine's paged attention (enginecore.attention); the model runs with
use_cache=False because the engine owns the KV cache. A Llama-architecture model runs the lean forward of
enginecore.lean_model instead, on the CPU and on CUDA (same weights, same attention, far fewer ops).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from enginecore import attention, attention_plan
from enginecore.kv_cache import KVCache
from enginecore.sequence import Sequence
from enginecore.step_inputs import StepInputs, build_step_inputs


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int, kv_cache: KVCache | None = None,
                 lean_model=None, attention_backend: str = "auto", max_num_seqs: int = 256):
        self.model = model
        self.lean_model = lean_model  # enginecore.lean_model.LeanLlama, or None: transformers' forward
        self.device = device
        self.block_size = block_size
        self.kv_cache = kv_cache
        attention.register()
        try:
            model.set_attn_implementation(attention.ATTENTION_NAME)
        except Exception as exc:  # a model class that does not go through the AttentionInterface
            raise RuntimeError(f"{type(model).__name__} cannot use the engine's paged attention: {exc}") from exc
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            raise RuntimeError(f"{type(model).__name__} does not support a pluggable attention implementation")
        # On CUDA in half precision a whole step is one varlen attention call per layer instead of several per
        # sequence; which kernel computes it is decided here (enginecore.attention_plan).
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        self.kernels = attention_plan.plan_varlen(
            device, model.dtype, heads, getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads, attention_backend, max_num_seqs)
        self.varlen = self.kernels is not None

    def prepare(self, entries: list[tuple[Sequence, int]]) -> StepInputs:
        return build_step_inputs(entries, self.block_size, self.device, varlen=self.varlen)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """[len(inputs.sample_rows), vocab] logits: the sampled rows, then any prompt-logprob rows."""
        with _attending(inputs, self.kv_cache, self.kernels):
            if self.lean_model is not None:
                return self.lean_model.forward(inputs.input_ids[0], inputs.positions[0], inputs.sample_rows)
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                use_cache=False,
                logits_to_keep=inputs.sample_rows,
            )
        return out.logits[0]

    @torch.inference_mode()
    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        """The lean forward's layers only: [T, hidden] before the final norm (what a CUDA graph of a step with
        prompt tokens holds); `logits` finishes the step."""
        with _attending(inputs, self.kv_cache, self.kernels):
            return self.lean_model.hidden(inputs.input_ids[0], inputs.positions[0])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        return self.lean_model.logits(hidden, sample_rows)


@contextmanager
def _attending(inputs: StepInputs, kv_cache: KVCache | None, kernels: attention.VarlenKernels | None):
    """The step paged attention computes while the model runs, and how (enginecore.attention.current)."""
    attention.current.step = inputs.attention
    attention.current.kv_cache = kv_cache
    attention.current.kernels = kernels or attention.VarlenKernels()
    try:
        yield
    finally:
        # The cache too: a global left holding it would keep a throwaway cache (the profiling step's) or a stopped
        # engine's alive, and count it as used when the next cache is sized.
        attention.current.step = None
        attention.current.kv_cache = None
