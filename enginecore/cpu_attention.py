"""Decode rows' paged attention on the CPU by our own C kernel (csrc/decode_attention.c): each row's query against
its context where it lies in the KV cache, in place of torch's gather, padding mask and SDPA.

Float32 only (the CPU's KV cache); where the kernel cannot be built (no C compiler) `decode` is None and the
engine keeps torch's path (enginecore.attention._decode).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from enginecore.native import NativeUnavailable, library

log = logging.getLogger(__name__)

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.decode_attention.argtypes = [_P, _I, _P, _P, _P, _I, _P, _I, _N, _N, _N, _N, ctypes.c_float, _P, _N]
    lib.decode_attention.restype = ctypes.c_int
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    try:
        return bind(library("decode_attention"))
    except NativeUnavailable as exc:
        log.info("decode attention by torch (gather, mask, SDPA): %s", exc)
        return None


def decode(q: torch.Tensor, kv: tuple[int, int, int, int], tables: torch.Tensor, lengths: torch.Tensor,
           scaling: float, lib: ctypes.CDLL) -> torch.Tensor:
    """q [rows, heads, d] (each row's heads contiguous); kv: one layer's cache as (K's address, V's address,
    block_size, kv_heads) (KVCache.layer_addresses); tables [rows * max_blocks] int64, lengths [rows] int64 (each
    >= 1) -> [rows, heads, d]."""
    rows, heads, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    k, v, block_size, kv_heads = kv
    out = torch.empty(rows, heads, d)
    if lib.decode_attention(q.data_ptr(), q.stride(0), k, v, tables.data_ptr(), tables.numel() // max(rows, 1),
                            lengths.data_ptr(), rows, heads, kv_heads, d, block_size, scaling, out.data_ptr(),
                            torch.get_num_threads()):
        raise MemoryError(f"decode attention of {rows} rows: no memory for the scores")
    return out
