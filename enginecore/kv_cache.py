"""The KV cache tensors, and how many blocks of them fit in the memory we may use.

Layout: one tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. A token's slot is
block * block_size + offset, so writing a step's new K/V is one index_copy_ per layer over a flat view, and
gathering a sequence's context is one index over its block table.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from enginecore.host_to_device import to_device

log = logging.getLogger(__name__)

# On the CPU the KV cache takes at most this share of the memory available at start-up by default.
CPU_DEFAULT_MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, hf_config) -> "KVShape":
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One block more than the pool hands out: padding rows of a CUDA-graph batch write their K/V there.
        self.scratch_block = num_blocks
        dims = (shape.num_layers, 2, num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)
        # Zeroed, not empty: masked-out slots still enter the softmax(QK)V product with weight 0, and 0 * NaN
        # garbage would be NaN.
        self.tensor = _zeros(dims, dtype, device)
        # Per layer: [2, num_blocks, block_size, kv_heads, head_dim], and K and V as flat [slots, kv_heads, head_dim].
        self.layers = [self.tensor[i] for i in range(shape.num_layers)]
        self.slots = [(t[0].flatten(0, 1), t[1].flatten(0, 1)) for t in self.layers]
        # Per layer (K's address, V's address, block_size, kv_heads), for the CPU's C kernels (taken once: a step
        # asks for them in every layer).
        self.layer_addresses = [(t[0].data_ptr(), t[1].data_ptr(), block_size, shape.num_kv_heads)
                                for t in self.layers]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write of a shared block), in every layer at once."""
        if not copies:
            return
        src = to_device([s for s, _ in copies], self.tensor.device)
        dst = to_device([d for _, d in copies], self.tensor.device)
        self.tensor[:, :, dst] = self.tensor[:, :, src]


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    # numpy's zeros comes from calloc: the pages are zero and only committed when first written, so a large pool
    # costs memory only as it fills (torch.zeros would touch every page at start-up).
    nbytes = int(np.prod(dims)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(dims)


def cpu_num_blocks(bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
                   kv_cache_memory: int | None) -> int:
    """--kv-cache-memory bytes if given; else enough for every sequence at full length, capped at a share of the
    memory available now."""
    if kv_cache_memory:
        budget = kv_cache_memory
        why = "--kv-cache-memory"
    else:
        wanted = max_num_seqs * -(-max_model_len // block_size) * bytes_per_block
        cap = int(psutil.virtual_memory().available * CPU_DEFAULT_MEMORY_SHARE)
        budget = min(wanted, cap)
        why = "max-num-seqs x max-model-len" if wanted <= cap else f"{CPU_DEFAULT_MEMORY_SHARE:.0%} of available memory"
    num_blocks = budget // bytes_per_block
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", num_blocks, block_size,
             num_blocks * bytes_per_block / 2**30, why)
    return int(num_blocks)


def cuda_num_blocks(device: torch.device, bytes_per_block: int, gpu_memory_utilization: float,
                    peak_activation_bytes: int) -> int:
    """What is left of gpu_memory_utilization x total memory after the weights (already allocated) and the
    activations of the largest step (measured by a profiling forward pass)."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others_and_us = total - free
    budget = int(total * gpu_memory_utilization) - used_by_others_and_us - peak_activation_bytes
    num_blocks = max(0, budget // bytes_per_block)
    log.info("KV cache: %d blocks (%.2f GiB of %.1f GiB, gpu-memory-utilization %.2f)", num_blocks,
             num_blocks * bytes_per_block / 2**30, total / 2**30, gpu_memory_utilization)
    return int(num_blocks)
