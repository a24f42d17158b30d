"""Linear weights stored column-major for the CPU's decode-sized matrix products.

nn.Linear computes x @ W.T with W stored [out, in] row-major, so MKL's sgemm reads its B operand transposed.
For the thin products of a decode step (a handful to a few dozen rows) that path is markedly slower on this
class of CPU: `bench/cpu_layout.py` prints each product of a SmolLM2 layer both ways (one run: a whole layer's
products 1.6x faster at 8 rows, 1.3x at 32, 1.07x at one) and the engine's decode throughput with each layout
(1.07x at 32 streams); prefill-sized products are unchanged. Storing W as the transpose of a contiguous [in, out] tensor keeps the parameter's shape, so the
model's own code runs unchanged while torch hands MKL an untransposed B.

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
