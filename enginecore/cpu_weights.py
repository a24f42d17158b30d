"""Linear weights of a transformers model re-laid column-major in place, for models the lean CPU forward does
not cover (enginecore.lean_model) when start-up timing found that layout faster on this CPU
(enginecore.cpu_setup.float32_layout; MKL takes other code paths on AMD than on Intel, so it is measured, not
assumed). Storing W as the transpose of a contiguous [in, out] tensor keeps the parameter's shape, so the
model's own code runs unchanged while torch hands the BLAS an untransposed B.

Weights shared with an embedding (a tied LM head) keep their layout: an embedding lookup wants whole rows.
"""
from __future__ import annotations

import torch


def store_linear_weights_column_major(model: torch.nn.Module) -> int:
    """Re-lay every nn.Linear weight of a CPU model in place; returns how many were changed."""
    embedding_storage = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    changed = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.data_ptr() in embedding_storage:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
            continue
        weight.data = weight.data.t().contiguous().t()
        changed += 1
    return changed
