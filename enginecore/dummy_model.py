"""`--load-format dummy` (vLLM's name): the model built from its config.json with random weights, directly on the
device, so an 8B model starts in seconds with nothing on disk. For benchmarks: speed depends on the shapes,
not on the values.

How: the modules are constructed under `torch.device(device)` in the target dtype with transformers' weight
initialisation switched off (no float32 model on the CPU first, no per-module init pass: that pass alone took
17 s for Llama-3.2-1B on the 2-core CPU), then tied as the config says, then filled. The fill tiles one block of
normal(0, initializer_range) values over every matrix, each parameter starting at another place in the block:
a memory-bound copy (0.06 s per 300M bfloat16 values on the CPU, where `normal_` takes 3.6 s), with no two
rows alike. The tiled source is as long as the largest matrix (the embedding: 0.5 GB for Llama-3.2-1B in
bfloat16, 1 GB for 8B), held only while filling. One-dimensional parameters are the norms' scales (ones) and biases (zeros). Buffers computed at
construction (RoPE frequencies) are computed on the device as usual.
"""
from __future__ import annotations

import torch

_BLOCK = 1_000_003  # a prime: rows of any width start at different places in it
_SHIFT = 104_729  # another prime: where each next parameter starts


def build_dummy_model(hf_config, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                      seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()  # skipped with the initialisation
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    fill_random(model, float(getattr(text_config, "initializer_range", 0.02) or 0.02), seed)
    return model


@torch.no_grad()
def fill_random(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(_BLOCK, generator=generator) * std
    matrices = [(i, p) for i, (_, p) in enumerate(model.named_parameters()) if p.dim() > 1]  # a tied weight once
    # One source as long as the largest matrix plus a block, tiled from the block: each matrix is then a single
    # contiguous copy from its own starting place.
    longest = max((p.numel() for _, p in matrices), default=0) + _BLOCK
    sources: dict[tuple, torch.Tensor] = {}
    for index, param in matrices:
        key = (param.device, param.dtype)
        if key not in sources:
            sources[key] = _tiled(block.to(device=param.device, dtype=param.dtype), longest)
        start = index * _SHIFT % _BLOCK
        param.view(-1).copy_(sources[key][start:start + param.numel()])
    sources.clear()
    for name, param in model.named_parameters():
        if param.dim() <= 1:
            param.fill_(0.0 if name.endswith("bias") else 1.0)


def _tiled(block: torch.Tensor, length: int) -> torch.Tensor:
    whole = -(-length // block.numel())
    return block.expand(whole, block.numel()).reshape(-1)[:length]


def _no_init_weights():
    try:  # transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()
