"""A decode-only step's decoder layers in one C call (csrc/decode_layers.c), where the lean forward's products are
all our int8 kernel's: the same kernels the layers would call one by one, without some 270 trips through Python and
ctypes a step (about 3 ms of a 9.7 ms one-stream step of SmolLM2-135M on 2 cores). Steps with prompt tokens, and
every other kind of product, keep the layer-by-layer path."""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from enginecore.cpu_int8 import PackedInt8Linear
from enginecore.native import NativeUnavailable, library

log = logging.getLogger(__name__)

_P, _I, _N, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def decode_layers_library() -> ctypes.CDLL | None:
    try:
        lib = library("decode_layers")
    except NativeUnavailable as exc:
        log.info("decode steps layer by layer: %s", exc)
        return None
    lib.decode_layers.argtypes = [_P, _I, _P, _N, _N, _N, _N, _N, _N, _N, _F, _F, _P, _P, _P, _P, _I, _P, _N]
    lib.decode_layers.restype = ctypes.c_int
    return lib


class CpuDecodeLayers:
    def __init__(self, lean, lib: ctypes.CDLL):
        self.lean = lean
        self.lib = lib
        self._table_for: tuple[int, torch.Tensor] | None = None  # the KV cache's address and the layers' table

    @classmethod
    def for_model(cls, lean) -> "CpuDecodeLayers | None":
        """None unless every product of every layer is our int8 kernel and the library builds."""
        kernels = [k for layer in lean.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not kernels or not all(isinstance(k, PackedInt8Linear) for k in kernels):
            return None
        lib = decode_layers_library()
        return None if lib is None else cls(lean, lib)

    def applies(self, step, cache, tokens: int) -> bool:
        """A step of decodes alone, on the CPU's float32 cache, with every row's context length."""
        return (step is not None and cache is not None and step.varlen is None and not step.prefills
                and step.num_decodes == tokens and step.decode_lengths is not None
                and cache.tensor.device.type == "cpu" and cache.tensor.dtype == torch.float32)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, step, cache) -> torch.Tensor:
        """h [rows, hidden] (contiguous, this call's own: updated in place) through every layer; cos, sin_signed
        the lean forward's tables [rows, 1, d]."""
        lean = self.lean
        rows, hidden = h.shape
        tables = step.decode_blocks
        failed = self.lib.decode_layers(
            h.data_ptr(), rows, self._table(cache).data_ptr(), len(lean.layers), hidden, lean.heads, lean.kv_heads,
            lean.head_dim, lean.intermediate, cache.block_size, lean.eps, lean.scaling, cos.data_ptr(),
            sin_signed.data_ptr(), step.slot_mapping.data_ptr(), tables.data_ptr(), tables.numel() // rows,
            step.decode_lengths.data_ptr(), torch.get_num_threads())
        if failed:
            raise MemoryError(f"a decode step of {rows} rows: no memory for its buffers")
        return h

    def _table(self, cache) -> torch.Tensor:
        """[layers, 16] int64: each layer's norms, products (packed weights, outputs, bits a code) and K/V cache, in
        csrc/decode_layers.c's order."""
        key = cache.tensor.data_ptr()
        if self._table_for is None or self._table_for[0] != key:  # one cache per engine: keep the latest's
            rows = []
            for layer in self.lean.layers:
                k_cache, v_cache, _, _ = cache.layer_addresses[layer.layer_idx]
                row = [layer.input_norm.data_ptr()]
                for kernel in (layer.qkv, layer.o):
                    row += [kernel.packed.data_ptr(), kernel.out_features, kernel.bits]
                row += [layer.post_norm.data_ptr()]
                for kernel in (layer.gate_up, layer.down):
                    row += [kernel.packed.data_ptr(), kernel.out_features, kernel.bits]
                rows.append(row + [k_cache, v_cache])
            self._table_for = (key, torch.tensor(rows, dtype=torch.int64))
        return self._table_for[1]
