"""The lean forward's small ops on the CPU by our own C kernels (csrc/layer_ops.c): RMS norm, SiLU x up, and RoPE
with the K/V cache write, one call each where torch runs six to twelve ops. Float32; None where the library
cannot be built (the lean forward then keeps torch's ops)."""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from enginecore.native import NativeUnavailable, library

log = logging.getLogger(__name__)

_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuLayerOps:
    def __init__(self, lib: ctypes.CDLL):
        lib.rms_norm.argtypes, lib.rms_norm.restype = [_P, _I, _I, _I, _P, ctypes.c_float, _P, _N], None
        lib.silu_mul.argtypes, lib.silu_mul.restype = [_P, _I, _I, _P, _N], None
        lib.rope_store.argtypes, lib.rope_store.restype = [_P, _I, _N, _N, _N, _P, _P, _P, _P, _P, _P, _N], None
        self.lib = lib
        self._rms_norm, self._silu_mul, self._rope_store = lib.rms_norm, lib.silu_mul, lib.rope_store

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, n] (rows may be apart: a row-major view) -> [rows, n], as torch.rms_norm over the last dim."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, n = x.shape
        y = torch.empty(rows, n)
        self._rms_norm(x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(), eps, y.data_ptr(),
                       torch.get_num_threads())
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2n] (gate, then up), contiguous -> silu(gate) * up [rows, n]."""
        rows, n2 = gate_up.shape
        y = torch.empty(rows, n2 // 2)
        self._silu_mul(gate_up.contiguous().data_ptr(), rows, n2 // 2, y.data_ptr(), torch.get_num_threads())
        return y

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                   k_slots: torch.Tensor, v_slots: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) d] contiguous; cos, sin_signed [T, d], contiguous (the lean forward's
        tables, sin with its first half negated); slots [T] int64. Returns q rotated [T, heads, d]; k rotated and v
        go to their slots of the layer's cache (k_slots, v_slots [slots, kv_heads, d])."""
        tokens = qkv.shape[0]
        d = cos.shape[-1]
        q = torch.empty(tokens, heads, d)
        self._rope_store(qkv.contiguous().data_ptr(), tokens, heads, kv_heads, d, cos.data_ptr(),
                         sin_signed.data_ptr(), slots.data_ptr(), q.data_ptr(), k_slots.data_ptr(),
                         v_slots.data_ptr(), torch.get_num_threads())
        return q


@functools.cache
def layer_ops() -> CpuLayerOps | None:
    try:
        return CpuLayerOps(library("layer_ops"))
    except NativeUnavailable as exc:
        log.info("the lean forward's small ops by torch: %s", exc)
        return None
