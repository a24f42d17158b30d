"""int8 weights times float32 activations (W8A32), by our own C kernel (csrc/int8_linear.c), on any CPU with a C
compiler.

The weights are those of `--quantization int8` (one scale per output channel, the largest |w| of the row maps
to 127); the activations stay float32, so nothing is rounded but the weights. The kernel reads a quarter of
float32's weight bytes and widens each weight in registers: on a 2-core AMD EPYC (Zen 2, AVX2, no VNNI), where
oneDNN's int8 products come out wrong and torch's int8 weight-only kernel is 10-30x slower than float32, the whole
SmolLM2-135M's products from memory took 8.0 / 27.5 / 68.5 ms at 1 / 8 / 32 rows against oneDNN float32's
31.1 / 47.7 / 84.4 (bench/cpu_layout.py, 2026-12-07).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from enginecore.cpu_linear import LinearKernel, int8_dequantized, per_channel_int8
from enginecore.native import NativeUnavailable, library

_P, _I = ctypes.c_void_p, ctypes.c_int64


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's functions (ctypes would otherwise pass 64-bit sizes and pointers as C ints)."""
    lib.int8_panel.argtypes, lib.int8_panel.restype = [], ctypes.c_int
    lib.int8_pack.argtypes, lib.int8_pack.restype = [_P, _I, _I, _P], None
    lib.int8_linear.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, ctypes.c_int]
    lib.int8_linear.restype = ctypes.c_int
    return lib


@functools.cache
def kernels() -> ctypes.CDLL:
    return bind(library("int8_linear"))


class PackedInt8Linear(LinearKernel):
    """W [out, in] as int8 per output channel, packed into the kernel's panels once; x [rows, in] float32."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL | None = None):
        self.lib = lib or kernels()
        self.out_features, self.in_features = weight.shape
        q, self.scale = per_channel_int8(weight)
        panel = self.lib.int8_panel()
        self.packed = torch.empty(-(-self.out_features // panel) * panel * self.in_features, dtype=torch.int8)
        self.lib.int8_pack(q.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())
        # What every call passes, looked up once: a decode step makes over a hundred of these calls.
        self._product = self.lib.int8_linear
        self._weights = (self.in_features, self.packed.data_ptr(), self.scale.data_ptr(), self.out_features)

    def __call__(self, x, residual=None):
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features)
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        if self._product(x.data_ptr(), rows, *self._weights, None if residual is None else residual.data_ptr(),
                         y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"int8 product of {rows} rows: no memory for the rows' scratch")
        return y


@functools.cache
def packed_int8_unavailable_reason() -> str | None:
    """Why `PackedInt8Linear` cannot run here, or None: no compiler, or a build that multiplies wrong."""
    try:
        kernels()
    except NativeUnavailable as exc:
        return f"our int8 kernel cannot be built here: {exc}"
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 24, generator=gen), torch.randn(9, 24, generator=gen)
    exact = x @ int8_dequantized(w).T
    for rows in (1, 9):  # both of its paths
        got = PackedInt8Linear(w)(x[:rows])
        if not torch.allclose(got, exact[:rows], rtol=1e-4, atol=1e-4):
            return f"our int8 kernel multiplies wrong here (off by {(got - exact[:rows]).abs().max().item():g})"
    return None
