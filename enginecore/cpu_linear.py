"""The CPU's matrix products: float32 weights in the layout this CPU multiplies fastest, or int8 weights.

A `LinearKernel` computes `x @ W.T (+ residual)` for x [rows, in]. Two kinds:

- `Float32Linear`: W in float32, stored row-major ([out, in], as nn.Linear) or column-major (the transpose of a
  contiguous [in, out]), multiplied by the BLAS (MKL); `OneDnnFloat32Linear`: W in float32 reordered once into
  oneDNN's blocked layout and multiplied by oneDNN's float32 kernels. Which is fastest depends on the CPU and
  the library's path on it (MKL takes other code paths on AMD than on Intel: on an AMD EPYC Zen 5 oneDNN's
  packed kernels ran a decode step's thin products 2.5-6x faster than MKL's), so `pick_float32_layout` times
  the three on the model's own shapes at start-up. Float32 throughout: only the order of the sums changes.
- `Int8Linear` (one of `--quantization int8`'s two kernels; the other is enginecore.cpu_int8's): W as int8 with one scale per output channel (symmetric, the largest
  |w| of the row maps to 127), and the activations quantized per row (per token) to int8 at each call, so
  the product runs on oneDNN's integer kernels (VNNI where the CPU has it). A decode step reads a quarter of
  the weight bytes of float32, which is what bounds it. This is W8A8 dynamic quantization, as vLLM's CPU
  `w8a8` path and torchao's `int8_dynamic_activation_int8_weight`: torch's int8 *weight-only* kernel
  (`_weight_int8pack_mm`) and its int4 kernel, timed by `bench/cpu_layout.py`, were 10-30x slower than
  float32 on the CPUs measured, so they are not offered.
"""
from __future__ import annotations

import functools
import time

import torch


class LinearKernel:
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class TorchLinear(LinearKernel):
    """torch's own product for the weight's device and dtype (cuBLAS on CUDA, the BLAS on the CPU), on the
    weight as given."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.weight_t = weight.t()  # [in, out]: what addmm multiplies by

    def __call__(self, x, residual=None):
        if residual is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(residual, x, self.weight_t)  # the residual add in the product's output pass


class Float32Linear(TorchLinear):
    def __init__(self, weight: torch.Tensor, column_major: bool):
        super().__init__(weight.t().contiguous().t() if column_major else weight.contiguous())
        self.column_major = column_major


class OneDnnFloat32Linear(LinearKernel):
    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)

    def __call__(self, x, residual=None):
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        if residual is not None:
            y.add_(residual)
        return y


FLOAT32_LINEARS = (Float32Linear, OneDnnFloat32Linear)
# The float32 kernels start-up timing chooses from, by name.
FLOAT32_KERNELS = {
    "row-major": lambda w: Float32Linear(w, False),
    "column-major": lambda w: Float32Linear(w, True),
    "onednn": OneDnnFloat32Linear,
}


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (int8 [out, in], float32 scale [out]), W ~= q * scale: symmetric per output channel, the
    largest |w| of a row maps to 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


class Int8Linear(LinearKernel):
    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        qweight, self.scale = per_channel_int8(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)

    def __call__(self, x, residual=None):
        qx, x_scale = quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(qx, 1.0, ACTIVATION_ZERO_POINT, self.packed, self.scale, self.zero_points, None, 1.0, 0,
                                               torch.float32, "none", [], "")
        y.mul_(x_scale)
        if residual is not None:
            y.add_(residual)
        return y


class Bf16Linear(LinearKernel):
    """W in bfloat16, x rounded to bfloat16 for the product only (norms, attention, softmax and the residual
    stream stay float32): oneDNN's bf16 kernels where the CPU has them natively (AVX512_BF16, AMX). The weight
    is reordered once into oneDNN's blocked layout: handed a plain tensor, oneDNN reorders it on every call,
    which made the products about 2x slower (a 576x49152 head at one row: 26.6 against 14.2 ms, loaded box)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(), None)

    def __call__(self, x, residual=None):
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "").float()
        if residual is not None:
            y.add_(residual)
        return y


# Activations go to oneDNN as uint8 around 128, not as int8: its kernels take unsigned activations (what VNNI's
# vpdpbusd multiplies); signed ones fell to a reference path 1000x slower (39 ms against 43 us for one
# 1x576x1536 product on an AMD EPYC with AVX-512 VNNI).
ACTIVATION_ZERO_POINT = 128


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float -> (uint8 [rows, in], scale [rows, 1]) with x ~= (q - 128) * scale, symmetric per row."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)
    return torch.round(x / scale).add_(ACTIVATION_ZERO_POINT).to(torch.uint8), scale


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (elsewhere oneDNN emulates it, slower than float32)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _product_of_ones(kernel) -> tuple[torch.Tensor | None, str | None]:
    """[2, 8] ones times a [4, 8] weight of ones (8 everywhere when right) through the LinearKernel class
    `kernel`, and None; or None and why it raised (where the torch build or the CPU lacks the kernel)."""
    try:
        return kernel(torch.ones(4, 8))(torch.ones(2, 8)), None
    except (RuntimeError, AttributeError) as exc:
        return None, (str(exc).splitlines() or [type(exc).__name__])[0]


def _right(y: torch.Tensor | None, rtol: float = 1e-5) -> bool:
    return y is not None and bool(torch.allclose(y, torch.full((2, 4), 8.0), rtol=rtol))


@functools.cache
def bf16_unavailable_reason() -> str | None:
    """Why `Bf16Linear` cannot run here, or None: oneDNN's bfloat16 products need AVX-512 (BW, VL, DQ),
    AVX-NE-CONVERT or AMX, and refuse an AVX2-only CPU (an AMD EPYC Zen 3, for one)."""
    y, error = _product_of_ones(Bf16Linear)
    if y is None:
        return f"oneDNN has no bfloat16 products on this CPU ({error})"
    return None if _right(y) else f"oneDNN's bfloat16 products are wrong on this CPU (ones gave {y[0, 0].item():g}, not 8)"


@functools.cache
def onednn_int8_unavailable_reason() -> str | None:
    """Why `Int8Linear` (oneDNN's W8A8) cannot run here, or None. A product of ones checks the result too: without VNNI
    (AVX-512 VNNI or AVX-VNNI) oneDNN's AVX2 int8 kernels add pairs of uint8 x int8 products in 16 bits, which
    saturate for activations near 255, so their products come out wrong."""
    y, _ = _product_of_ones(Int8Linear)
    if y is None:
        return "this torch build has no oneDNN quantized linear"
    if _right(y, rtol=0.02):
        return None
    vnni = {"avx512_vnni", "avx_vnni"} & cpu_flags()
    return (f"oneDNN's int8 products are wrong on this CPU ({'with ' + ', '.join(sorted(vnni)) if vnni else 'no VNNI'}: "
            f"a product of ones gave {y[0, 0].item():g}, not 8)")


# Most weights of one product that time_kernels multiplies (256 MB in float32, far past the caches, as the model's
# weights are in a decode step): a larger product (a 1B model's LM head of 128,256 x 2,048) is timed on as many of
# its output channels and its time scaled up, since past the caches a product's time grows in proportion. Timing
# the whole of a 1B model's products took 14 s of its start-up. SmolLM2-135M's are all smaller: timed whole.
MOST_TIMED_WEIGHTS = 64 * 2**20


def time_kernels(factories: dict, shapes: list[tuple[int, int]], batch_sizes=(1, 8, 32), repeat: int = 3) -> dict:
    """Seconds per kernel kind: every (in, out) product at each batch size, the kinds interleaved, best of
    `repeat` each (a busy neighbour slows all alike and the best time is the least disturbed), summed."""
    totals = {name: 0.0 for name in factories}
    gen = torch.Generator().manual_seed(0)
    for fan_in, fan_out in shapes:
        timed = min(fan_out, max(1, MOST_TIMED_WEIGHTS // fan_in))
        weight = torch.randn(timed, fan_in, generator=gen) * 0.05
        kernels = {name: make(weight) for name, make in factories.items()}
        for rows in batch_sizes:
            x = torch.randn(rows, fan_in, generator=gen)
            best = {name: float("inf") for name in factories}
            for _ in range(repeat):
                for name, kernel in kernels.items():
                    kernel(x)
                    started = time.perf_counter()
                    kernel(x)
                    best[name] = min(best[name], time.perf_counter() - started)
            for name in totals:
                totals[name] += best[name] * fan_out / timed
    return totals


def pick_float32_layout(shapes: list[tuple[int, int]], batch_sizes=(1, 8, 32)) -> dict:
    """The float32 kernel (FLOAT32_KERNELS) that multiplies the model's products fastest here: `kernel`, its
    name; `column_major`, the faster of MKL's two layouts (for transformers' own forward, which only re-lays
    its weights); the seconds of each."""
    kinds = dict(FLOAT32_KERNELS)
    if not onednn_float32_available():
        del kinds["onednn"]
    t = time_kernels(kinds, shapes, batch_sizes)
    kernel = min(t, key=t.__getitem__)
    timings = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in t.items())
    return {"kernel": kernel, "column_major": t["column-major"] < t["row-major"], "row_major_s": t["row-major"],
            "column_major_s": t["column-major"], "onednn_s": t.get("onednn"),
            "why": f"timed at start-up on {len(shapes)} product shapes x batch {list(batch_sizes)}: {timings}"}


def onednn_float32_available() -> bool:
    """Whether this torch build multiplies float32 with oneDNN's packed weights (x86 builds do)."""
    return _right(_product_of_ones(OneDnnFloat32Linear)[0])
