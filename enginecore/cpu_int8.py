"""8-bit weights times float32 activations (W8A32), by our own C kernel (csrc/int8_linear.c), on any CPU with a C
compiler.

The weights are stored as 8-bit codes per block of 32 columns of each output channel, with the block's scale and
offset (w = scale * code + offset, the block's least and largest weight at codes 0 and 255): a model converted
from a GGUF (Q4_1, Q5_1, Q8_0 blocks of 32) keeps its weights exactly, up to float rounding, and any other loses
far less than with one scale per channel (on bench/quantization.py's prompts float32's greedy token at 100% of the
positions, against 96.9% per channel). Where every code of a weight is under 16 (a GGUF's Q4_1 or Q4_0 blocks, as
the embedded model's layers are), two share a byte: the same products, 0.75 bytes a weight read instead of 1.25
(code_bits). The activations stay float32. The kernel reads a little over a quarter of
float32's weight bytes and widens each code in registers: on a 2-core AMD EPYC (Zen 2, AVX2, no VNNI), where
oneDNN's int8 products come out wrong and torch's int8 weight-only kernel is 10-30x slower than float32, the whole
SmolLM2-135M's products from memory took 7.3 / 24.1 / 62.6 ms at 1 / 8 / 32 rows against oneDNN float32's
29.7 / 45.4 / 85.8 (bench/cpu_layout.py, 2026-12-07).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from enginecore.cpu_linear import LinearKernel
from enginecore.native import NativeUnavailable, library

_P, _I = ctypes.c_void_p, ctypes.c_int64
BLOCK = 32  # columns per block of codes: csrc/int8_linear.c's BK


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's functions (ctypes would otherwise pass 64-bit sizes and pointers as C ints)."""
    lib.int8_block.argtypes, lib.int8_block.restype = [], ctypes.c_int
    lib.int8_packed_bytes.argtypes, lib.int8_packed_bytes.restype = [_I, _I, ctypes.c_int], ctypes.c_int64
    lib.int8_codes.argtypes, lib.int8_codes.restype = [_P, _I, _I, _P, _P, _P, ctypes.c_int], None
    lib.int8_pack.argtypes, lib.int8_pack.restype = [_P, _P, _P, _I, _I, _P, ctypes.c_int, ctypes.c_int], ctypes.c_int
    lib.int8_linear.argtypes = [_P, _I, _I, _P, _I, ctypes.c_int, _P, _P, ctypes.c_int]
    lib.int8_linear.restype = ctypes.c_int
    if lib.int8_block() != BLOCK:
        raise NativeUnavailable(f"the built kernel's blocks are of {lib.int8_block()} columns, not {BLOCK}")
    return lib


@functools.cache
def kernels() -> ctypes.CDLL:
    return bind(library("int8_linear"))


ROWS_AT_ONCE = 2048  # rows of a weight not in float32 made float32 at once: the temporary stays small beside an 8B model


def block_codes(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (codes uint8 [out, in], scale and offset float32 [out, blocks]): W ~= scale * code + offset
    per block of BLOCK columns, offset the block's least weight (csrc/int8_codes.h, on torch's threads).

    A GGUF's blocks are 32 columns on a grid: Q4_1's 16 values from its minimum (a step of its range / 15), Q5_1's
    32 (range / 31), Q8_0's d x (-127 .. 127) (the largest |w| / 127), Q4_0's and Q5_0's d x (-8 .. 7) and
    (-16 .. 15). A block that lies on one of those grids (within 1% of a step) takes the grid's codes and its step,
    fitted to all of the block's weights: its weights come back as they were, up to float rounding. Any other block
    has its range cut in 255 equal steps."""
    lib = lib or kernels()
    w = weight.detach()
    rows, cols = w.shape
    blocks = -(-cols // BLOCK)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scale, offset = torch.empty(rows, blocks), torch.empty(rows, blocks)
    for at in range(0, rows, ROWS_AT_ONCE):
        part = w[at:at + ROWS_AT_ONCE].float().contiguous()  # itself, where the weight is float32 and contiguous
        lib.int8_codes(part.data_ptr(), part.shape[0], cols, codes[at].data_ptr(), scale[at].data_ptr(),
                       offset[at].data_ptr(), torch.get_num_threads())
    return codes, scale, offset


def block_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight that PackedInt8Linear multiplies by, for `weight`."""
    codes, scale, offset = block_codes(weight)
    cols = weight.shape[1]
    return codes.float() * scale.repeat_interleave(BLOCK, dim=1)[:, :cols] + offset.repeat_interleave(BLOCK, dim=1)[:, :cols]


def code_bits(codes: torch.Tensor) -> int:
    """Bits a code the kernel keeps `codes` in: 4 where every one is under 16 (a weight from a GGUF's Q4_1 or Q4_0
    blocks: their 16 values), else 8. Either way the same codes, scales and offsets, so the same products; at 4
    bits a decode step reads 0.75 bytes a weight instead of 1.25."""
    return 4 if codes.numel() and int(codes.max()) < 16 else 8


class PackedInt8Linear(LinearKernel):
    """W [out, in] as codes of 8 bits or fewer (code_bits) per block, packed into the kernel's panels once;
    x [rows, in] float32."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL | None = None, bits: int | None = None):
        self.lib = lib or kernels()
        self.out_features, self.in_features = weight.shape
        codes, scale, offset = block_codes(weight, self.lib)
        self.bits = bits or code_bits(codes)
        self.packed = torch.empty(self.lib.int8_packed_bytes(self.out_features, self.in_features, self.bits),
                                  dtype=torch.uint8)
        if self.lib.int8_pack(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), self.out_features,
                              self.in_features, self.packed.data_ptr(), self.bits, torch.get_num_threads()):
            raise ValueError(f"the weight's codes do not fit in {self.bits} bits")
        # What every call passes, looked up once: a decode step makes over a hundred of these calls.
        self._product = self.lib.int8_linear
        self._weights = (self.in_features, self.packed.data_ptr(), self.out_features, self.bits)

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


def packed_summary(kernels: list) -> str:
    """How our int8 kernel keeps a model's products, for the log: how many at 4 bits a code, and their bytes."""
    ours = [k for k in kernels if isinstance(k, PackedInt8Linear)]
    four = sum(k.bits == 4 for k in ours)
    mib = sum(k.packed.numel() for k in ours) / 2**20
    return f"{four} of {len(ours)} products in 4-bit codes (16 values a block), packed weights {mib:.0f} MiB"


@functools.cache
def packed_int8_unavailable_reason() -> str | None:
    """Why `PackedInt8Linear` cannot run here, or None: no compiler, or a build that multiplies wrong."""
    try:
        kernels()
    except NativeUnavailable as exc:
        return f"our int8 kernel cannot be built here: {exc}"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 24, generator=gen)
    for w in (torch.randn(40, 24, generator=gen), sixteen_values(40, 24, gen)):  # 8 and 4 bits a code
        exact = x @ block_dequantized(w).T
        for rows in (1, 9):  # both of its paths
            got = PackedInt8Linear(w)(x[:rows])
            if not torch.allclose(got, exact[:rows], rtol=1e-4, atol=1e-4):
                return f"our int8 kernel multiplies wrong here (off by {(got - exact[:rows]).abs().max().item():g})"
    return None


def sixteen_values(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A weight on Q4_1's grid in every block (its 16 values, the least and the largest in each), whose codes the
    kernel keeps in 4 bits."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen).float()
    codes[:, ::BLOCK], codes[:, 1::BLOCK] = 0, 15
    return codes * 0.01 - 0.05
