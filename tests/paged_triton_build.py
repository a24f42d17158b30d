"""Compile the engine's Triton kernels for a GPU without one: every launch paged_varlen makes (each decode tile,
steps with prompt tokens, the split merge) and rope_triton's, for the heads of SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B, through
Triton's compiler and its bundled ptxas, for Hopper (sm_90, the H200) and Ampere (sm_80). Prints one JSON line per
kernel: its shared memory, registers and spilled bytes (ptxas -v), and the sizes of its asynchronous copies to
shared memory (how it loads K and V). tests/test_paged_triton_build.py runs it in a
process of its own (the test session runs Triton's interpreter, whose kernels cannot be compiled).

Each launch is compiled as Triton's JIT would specialize it: the launch's own arguments, built by paged_varlen's
own code (paged_triton.launches) on CPU tensors laid out as the engine's; 16-byte alignment and divisibility by 16
where Triton would find them (pointers to aligned tensors, integers divisible by 16) and the kernel's decorator does
not exempt them.

    .venv/bin/python tests/paged_triton_build.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from enginecore import paged_triton, rope_triton  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def steps(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """(what, launch) for a decode-only step with each tile, one that splits, and one with a prompt chunk."""
    layer_kv = torch.zeros(2, 9, 16, kv_heads, head_dim, dtype=dtype)

    def made(runs: list[tuple[int, int]], max_k: int, tile):
        tokens = sum(n for n, _ in runs)
        fused = torch.zeros(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)  # the lean forward's q/k/v rows
        ints = dict(dtype=torch.int32)
        _, launches = paged_triton.launches(
            fused[:, :heads], layer_kv, torch.zeros(8, dtype=torch.int64),
            torch.tensor([0] + [n for n, _ in runs], **ints).cumsum(0, dtype=torch.int32),
            torch.zeros(len(runs) + 1, **ints), torch.tensor([c for _, c in runs], **ints),
            max(n for n, _ in runs), max_k, head_dim ** -0.5, tile)
        return launches

    for tile in paged_triton.DECODE_TILES:
        yield f"decodes, tile {paged_triton.tile_name(tile)}", made([(1, 100)] * 256, 512, tile)[0]
    split = made([(1, 8000)], 8192, paged_triton.DECODE_TILES[0])
    assert len(split) == 2, "a long lone decode splits"
    yield "split merge", split[1]
    yield "prompt chunk", made([(1, 100), (512, 1024)], 1024, paged_triton.DECODE_TILES[0])[0]
    tokens = 256
    qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    rope_tables = torch.zeros(tokens, 1, head_dim, dtype=dtype)
    slots = layer_kv[0].flatten(0, 1)
    yield "rope + cache write", rope_triton.rope_launch(qkv, rope_tables, rope_tables, torch.zeros(tokens, dtype=torch.int64),
                                                        slots, layer_kv[1].flatten(0, 1), heads, kv_heads)[1]


def compile_launch(launch: paged_triton.Launch, target: GPUTarget):
    fn = launch.kernel
    names = fn.arg_names
    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip(names, launch.args))
    for i, name in enumerate(names):
        if name in launch.meta:
            signature[name], constexprs[name] = "constexpr", launch.meta[name]
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0 and name not in fn.do_not_specialize_on_alignment
        elif isinstance(value, float):
            signature[name], aligned = "fp32", False
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        if aligned and name not in fn.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: launch.meta[k] for k in ("num_warps", "num_stages") if k in launch.meta}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=target,
                          options=options)


def resources(kernel, arch: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        ptx_arch = re.search(r"^\.target (\w+)", kernel.asm["ptx"], re.M).group(1)  # sm_90a on Hopper
        report = subprocess.run([PTXAS, f"-arch={ptx_arch}", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    # The sizes of its asynchronous copies from global to shared memory: how K and V are loaded (16 bytes:
    # vectorized and pipelined; none: loaded through registers, as Triton does when it cannot prove alignment).
    copies = re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", kernel.asm["ptx"])
    return {"shared": kernel.metadata.shared, "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spilled": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
            "async_copy_bytes": sorted({int(size, 0) for size in copies})}


def main() -> None:
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for what, launch in steps(heads, kv_heads, head_dim, torch.bfloat16):
            for arch, target in TARGETS.items():
                row = {"shape": shape, "kernel": what, "arch": arch}
                try:
                    row.update(resources(compile_launch(launch, target), arch))
                except Exception as exc:  # the test reports it
                    row["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
