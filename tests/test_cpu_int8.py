"""Our int8 kernel (enginecore/csrc/int8_linear.c through enginecore.cpu_int8): every product equals float32's
with the same 8-bit weights, on every path of the kernel (one row, a few rows widened in registers, tiles over a
widened panel, columns past a chunk or a block, channels past a panel), as built for this CPU and as plain C; a
GGUF-shaped weight (16 values a block) is kept exactly, in 4-bit codes with the 8-bit ones' products; the codes (csrc/int8_codes.h) equal those of the same steps
in torch; bit for bit whatever the thread count; and without a compiler it says why, and the engine falls back or
refuses in one line."""
import ctypes
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from enginecore import native
from enginecore.cpu_int8 import (BLOCK, PackedInt8Linear, bind, block_codes, block_dequantized, kernels,
                                 packed_int8_unavailable_reason, sixteen_values)
from enginecore.cpu_linear import onednn_int8_unavailable_reason

from tests.supervise_process import SUPERVISE, model_cache_without_native_builds

pytestmark = pytest.mark.skipif(packed_int8_unavailable_reason() is not None,
                                reason=f"our int8 kernel does not run here: {packed_int8_unavailable_reason()}")

# rows: 1 (its own loop), 2-3 (widened in registers), 4+ (tiles of 6 over a widened panel, the last shorter);
# columns past 256 (the widened chunk) and blocks of 32 cut short; channels that do not fill a panel of 16.
SHAPES = [(rows, fan_in, fan_out) for rows in (1, 2, 3, 4, 6, 7, 13, 33) for fan_in, fan_out in
          ((8, 16), (3, 1), (577, 17), (256, 40), (300, 96))] + [(70, 1536, 33)]


def product_error(kernel: PackedInt8Linear, weight: torch.Tensor, rows: int, residual: bool) -> float:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.shape[1], generator=gen)
    r = torch.randn(rows, weight.shape[0], generator=gen) if residual else None
    exact = x.double() @ block_dequantized(weight).double().T + (r.double() if residual else 0)
    got = kernel(x, residual=r)
    assert got.shape == (rows, weight.shape[0]) and got.dtype == torch.float32
    return ((got.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows, fan_in, fan_out", SHAPES)
def test_every_product_equals_float32_with_the_same_int8_weights(rows, fan_in, fan_out):
    weight = torch.randn(fan_out, fan_in, generator=torch.Generator().manual_seed(fan_in)) * 0.05
    kernel = PackedInt8Linear(weight)
    assert kernel.bits == 8
    for residual in (False, True):
        assert product_error(kernel, weight, rows, residual) < 1e-5


@pytest.mark.parametrize("rows, fan_in, fan_out", SHAPES)
def test_a_weight_of_16_values_a_block_is_kept_in_4_bits_with_the_same_products(rows, fan_in, fan_out):
    """Q4_1's blocks (16 values) take 4-bit codes, 0.6 of the 8-bit ones' bytes: the products equal float32's
    with the weight itself, and the same codes kept in 8 bits give them bit for bit, on every path."""
    weight = sixteen_values(fan_out, fan_in, torch.Generator().manual_seed(fan_in))
    four, eight = PackedInt8Linear(weight), PackedInt8Linear(weight, bits=8)
    assert (four.bits, eight.bits) == (4, 8)
    assert four.packed.numel() == eight.packed.numel() * 384 // 640  # a block: 128 bytes of scales, then codes
    x = torch.randn(rows, fan_in, generator=torch.Generator().manual_seed(rows))
    r = torch.randn(rows, fan_out, generator=torch.Generator().manual_seed(rows + 1))
    for residual in (None, r):
        got = four(x, residual=residual)
        assert torch.equal(got, eight(x, residual=residual))
        exact = x.double() @ weight.double().T + (0 if residual is None else residual.double())
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5


def test_codes_past_15_are_refused_in_4_bits():
    """The packing checks what it is given: a code that does not fit in 4 bits is not cut to its low bits."""
    weight = sixteen_values(20, 70, torch.Generator().manual_seed(0))
    weight[3, 40] = 1.0  # off its block's grid: the block's range in 255 steps
    assert PackedInt8Linear(weight).bits == 8
    with pytest.raises(ValueError, match="do not fit in 4 bits"):
        PackedInt8Linear(weight, bits=4)


def test_a_weight_of_gguf_blocks_is_kept_exactly():
    """A weight converted from a GGUF's Q4_1 (16 values, scale * q + min, in each block of 32 columns) or Q8_0 comes
    back as it was, up to float rounding; the product then equals float32's with the weight itself."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 48, 4 * BLOCK  # whole blocks, as a GGUF's rows are
    blocks = -(-cols // BLOCK)
    scale = (torch.rand(rows, blocks, generator=gen) * 0.01).repeat_interleave(BLOCK, dim=1)[:, :cols]
    least = (torch.randn(rows, blocks, generator=gen) * 0.05).repeat_interleave(BLOCK, dim=1)[:, :cols]
    # As llama.cpp quantizes: Q4_1's minimum at code 0 and its maximum at 15 in every block; Q8_0's largest |w| at
    # +-127 (scale * q, symmetric).
    q4_1 = torch.randint(0, 16, (rows, cols), generator=gen).float()
    q4_1[:, ::BLOCK], q4_1[:, 1::BLOCK] = 0, 15
    q8_0 = (torch.randn(rows, cols, generator=gen) * 40).round().clamp(-127, 127)
    q8_0[:, ::BLOCK] = -127
    for codes, offset in ((q4_1, least), (q8_0, 0)):
        weight = codes * scale + offset
        weight[:, :BLOCK] = 0.25  # a block of one value
        assert torch.allclose(block_dequantized(weight), weight, rtol=0, atol=1e-6 * weight.abs().max().item())
        x = torch.randn(5, cols, generator=gen)
        for n in (1, 3, 5):
            assert torch.allclose(PackedInt8Linear(weight)(x[:n]), x[:n] @ weight.T, rtol=1e-5, atol=1e-5)
    codes, _, _ = block_codes(weight)
    assert codes.dtype == torch.uint8 and int(codes[:, BLOCK:].min()) == 0 and int(codes[:, :BLOCK].max()) == 0
    arbitrary = torch.randn(rows, cols, generator=gen)  # on no grid: its range in 255 steps
    error = (block_dequantized(arbitrary) - arbitrary).abs().view(rows, -1)
    assert 0 < error.max() <= 0.51 * (arbitrary.max() - arbitrary.min()) / 255


def test_a_block_on_a_grid_in_its_first_columns_only_is_cut_in_255_steps():
    """A grid is tried on each block's first columns, then on the whole of the blocks that pass: a block that lies
    on Q4_1's grid only in those columns is not taken for one."""
    gen = torch.Generator().manual_seed(1)
    rows, cols = 8, 2 * BLOCK
    step = 0.01
    weight = torch.randint(0, 16, (rows, cols), generator=gen).float() * step
    weight[:, ::BLOCK], weight[:, 1::BLOCK] = 0, 15 * step  # the range of 15 steps, in the first columns
    weight[:, 5::BLOCK] += step / 3  # off the grid further on
    codes, _, _ = block_codes(weight)
    assert len(codes.unique()) > 16
    error = (block_dequantized(weight) - weight).abs()
    assert error.max() <= 0.51 * 15 * step / 255


def test_a_weight_made_over_in_pieces_of_rows_is_the_same(monkeypatch):
    from enginecore import cpu_int8

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(37, 3 * BLOCK + 5, generator=gen).bfloat16()
    whole = block_codes(weight)
    monkeypatch.setattr(cpu_int8, "ROWS_AT_ONCE", 8)
    pieces = block_codes(weight)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))


def reference_block_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_codes's steps in torch's tensor operations, whole weights at once (what the engine ran before
    csrc/int8_codes.h): each block's least and largest, each grid tried on the blocks' first SAMPLE columns and then
    whole, the codes, and the step of a block on a grid fitted by least squares."""
    SAMPLE = 4
    w = w.float()
    rows, cols = w.shape
    blocks = -(-cols // BLOCK)
    pad = blocks * BLOCK - cols
    least = torch.nn.functional.pad(w, (0, pad), value=float("inf")).view(rows, blocks, BLOCK).amin(-1)
    largest = torch.nn.functional.pad(w, (0, pad), value=float("-inf")).view(rows, blocks, BLOCK).amax(-1)
    above = torch.nn.functional.pad(w, (0, pad)).view(rows, blocks, BLOCK) - least[..., None]
    if pad:
        above[:, -1, BLOCK - pad:] = 0  # the padding: at the least, code 0
    span = largest - least
    most = torch.maximum(least.abs(), largest.abs())
    scale = span / 255.0
    on_grid = torch.zeros_like(span, dtype=torch.bool)
    pending = span > 0

    def on(values, step):
        steps = values / step[..., None]
        return (steps.amax(-1) < 255.5) & (steps.sub_(steps.round()).abs_().amax(-1) < 0.01)

    for step in (span / 15, span / 31, most / 127, most / 8, most / 16):
        candidates = pending & on(above[..., :SAMPLE], step)
        if not candidates.any():
            continue
        where = candidates.nonzero(as_tuple=True)  # only these blocks tried whole
        fits = torch.zeros_like(pending)
        fits[where] = on(above[where], step[where])
        scale = torch.where(fits, step, scale)
        on_grid |= fits
        pending &= ~fits
    codes = torch.round(above / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]).clamp_(0, 255)
    fitted = ((codes.double() * above).sum(-1) / (codes.double() * codes).sum(-1).clamp_min(1)).float()
    scale = torch.where(on_grid, fitted, scale)
    return codes.view(rows, -1)[:, :cols].to(torch.uint8), scale, least


def gguf_like(rows: int, cols: int, levels: int, symmetric: bool, gen: torch.Generator) -> torch.Tensor:
    """Blocks of `levels` values a step apart, as llama.cpp makes them: from the block's minimum (Q4_1, Q5_1), or
    d x (-levels/2 .. levels/2 - 1) with the largest |w| at -levels/2 (Q4_0, Q5_0) or d x (-127 .. 127) (Q8_0)."""
    blocks = -(-cols // BLOCK)
    step = (torch.rand(rows, blocks, generator=gen) * 0.01 + 1e-4).repeat_interleave(BLOCK, dim=1)[:, :cols]
    if symmetric:
        low = -127 if levels == 255 else -(levels // 2)
        codes = torch.randint(low, -low + (levels != 255), (rows, cols), generator=gen).float()
        codes[:, ::BLOCK] = low
        return codes * step
    codes = torch.randint(0, levels, (rows, cols), generator=gen).float()
    codes[:, ::BLOCK], codes[:, 1::BLOCK] = 0, levels - 1
    return codes * step + (torch.randn(rows, -(-cols // BLOCK), generator=gen) * 0.05).repeat_interleave(BLOCK, 1)[:, :cols]


@pytest.mark.parametrize("cols", [1, 3, 5, BLOCK, 2 * BLOCK + 3, 577])
def test_the_codes_equal_those_of_the_same_steps_in_torch(cols):
    """On every kind of block: arbitrary weights, each GGUF grid, a block of one value, a block on a grid in its first
    columns only, a last block cut short; float32 and bfloat16."""
    gen = torch.Generator().manual_seed(cols)
    rows = 24
    kinds = [torch.randn(rows, cols, generator=gen) * 0.05,
             gguf_like(rows, cols, 16, False, gen), gguf_like(rows, cols, 32, False, gen),
             gguf_like(rows, cols, 16, True, gen), gguf_like(rows, cols, 32, True, gen),
             gguf_like(rows, cols, 255, True, gen), torch.full((rows, cols), 0.25), torch.zeros(rows, cols)]
    off_grid = gguf_like(rows, cols, 16, False, gen)
    off_grid[:, 5::BLOCK] += 0.003
    kinds.append(off_grid)
    mixed = torch.cat([kinds[r % len(kinds)][r:r + 1] for r in range(rows)])  # unlike blocks side by side
    for weight in [*kinds, mixed, mixed.bfloat16(), mixed.T.contiguous().T]:
        codes, scale, offset = block_codes(weight)
        ref_codes, ref_scale, ref_offset = reference_block_codes(weight)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(offset, ref_offset)
        assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)


def test_the_result_is_the_same_bit_for_bit_on_one_thread_and_on_all():
    """Each output is one thread's sum in one order, so the thread governor's changes change no token."""
    weight = torch.randn(1000, 576) * 0.05
    kernel = PackedInt8Linear(weight)
    before = torch.get_num_threads()
    try:
        for rows in (1, 4, 32):
            x = torch.randn(rows, 576)
            torch.set_num_threads(1)
            one = kernel(x)
            torch.set_num_threads(max(2, os.cpu_count() or 2))
            assert torch.equal(kernel(x), one)
    finally:
        torch.set_num_threads(before)


def test_a_non_contiguous_input_is_multiplied_as_its_values():
    weight = torch.randn(48, 64) * 0.05
    x = torch.randn(64, 9).T  # [9, 64], not contiguous
    assert torch.allclose(PackedInt8Linear(weight)(x), x @ block_dequantized(weight).T, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="plain C is what other CPUs build anyway")
def test_the_plain_c_path_equals_float32_too(tmp_path):
    """Built without AVX2 (the path a CPU without it, or another architecture, compiles), through the same
    binding."""
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    library = tmp_path / "plain.so"
    subprocess.run([cc, "-O2", "-fopenmp", "-mno-avx2", "-mno-fma", "-shared", "-fPIC", "-o", str(library),
                    str(native.SOURCES / "int8_linear.c")], check=True, timeout=120)
    plain = bind(ctypes.CDLL(str(library)))
    for rows, fan_in, fan_out in [(1, 577, 17), (7, 300, 96), (33, 8, 16)]:
        for weight in (torch.randn(fan_out, fan_in) * 0.05, sixteen_values(fan_out, fan_in, torch.Generator())):
            kernel = PackedInt8Linear(weight, lib=plain)
            assert kernel.bits == (4 if weight.unique().numel() <= 16 else 8)
            assert product_error(kernel, weight, rows, residual=True) < 1e-5


def test_the_built_library_is_kept_and_loaded_again_without_a_build(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    probe = "from enginecore.cpu_int8 import packed_int8_unavailable_reason as r; print(r())"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "None", done.stderr
    built = list((tmp_path / "supervise" / "native").glob("int8_linear-*.so"))
    assert len(built) == 1
    assert not list((tmp_path / "supervise" / "native").glob("*.partial"))


def test_without_a_compiler_the_kernel_says_why(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": shutil.which("false") or "/bin/false"}
    probe = "from enginecore.cpu_int8 import packed_int8_unavailable_reason as r; print(r())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("our int8 kernel cannot be built here: "), done.stdout + done.stderr
    assert "int8_linear.c" in done.stdout


@pytest.mark.skipif(onednn_int8_unavailable_reason() is None, reason="oneDNN's int8 runs here: int8 stays possible")
def test_int8_without_a_compiler_and_without_vnni_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": model_cache_without_native_builds(tmp_path / "cache"),
           "CC": shutil.which("false") or "/bin/false"}
    result = subprocess.run([SUPERVISE, "--quantization", "int8", "--port", "0"], capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL, env=env)
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("supervise: error: --quantization int8: our int8 kernel cannot "
                                                     "be built here"), errors
    assert "oneDNN's int8 products are wrong" in errors[0] and errors[0].endswith("; use --quantization none")
    assert "Traceback" not in result.stdout + result.stderr


def test_the_engine_uses_it_where_it_is_int8s_kernel():
    from enginecore.cpu_setup import int8_kernel
    from tests.test_engine_support import make_engine

    engine = make_engine(quantization="int8")
    if int8_kernel(engine.loaded.model)["kernel"] != "W8A32 (ours)":
        pytest.skip("oneDNN's W8A8 is the faster here")
    lean = engine.runner.lean_model
    assert all(isinstance(k, PackedInt8Linear) for k in lean.linears())
    assert kernels() is lean.head.lib
    # the embedded GGUF's layers are Q4_1 blocks (4-bit codes), its LM head Q8_0 (8-bit)
    assert [k.bits for k in lean.linears()] == [4] * (len(lean.linears()) - 1) + [8]


def test_a_build_directory_others_can_write_to_is_not_used(tmp_path):
    """A library found there is loaded and run: a directory someone else could write to (a name under /tmp made
    first by another user) is passed over, and with no other the kernel is unavailable, saying why."""
    cache, temporary = tmp_path / "cache", tmp_path / "tmp"
    for shared in (cache / "supervise" / "native", temporary / f"supervise-native-{os.getuid()}"):
        shared.mkdir(parents=True)
        shared.chmod(0o777)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "TMPDIR": str(temporary)}
    probe = "from enginecore.cpu_int8 import packed_int8_unavailable_reason as r; print(r())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("our int8 kernel cannot be built here: no directory of ours alone"), done.stdout
    assert "not ours alone" in done.stderr
    assert not list(cache.rglob("*.so")) and not list(temporary.rglob("*.so"))
    (temporary / f"supervise-native-{os.getuid()}").chmod(0o700)  # ours alone again: used
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "None" and list(temporary.rglob("int8_linear-*.so")), done.stdout + done.stderr
