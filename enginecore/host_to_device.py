"""Small host values (lists, numpy arrays) onto the engine's device without waiting for it.

A plain `torch.tensor(values, device="cuda")` or `.to("cuda")` from pageable memory synchronizes the stream: the
host waits until every kernel queued before has run. Under asynchronous scheduling the host prepares step k+1 while
step k's forward pass runs, so such a copy would wait for that pass and undo the overlap. With non_blocking the
copy is only queued: CUDA stages a pageable source before the call returns, so the host buffer may go at once.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
