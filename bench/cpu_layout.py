"""Where a CPU decode step goes on this machine, and which path the engine picks here and why.

Each table side by side in one run:
1. the CPU (model, the vector and matrix extensions torch and oneDNN can use) and the engine's choices on it:
   the float32 weight layout (timed at start-up, the engine's own function) and the default quantization;
2. memory read bandwidth and the single-stream ceiling it sets for float32 and int8 weights;
3. one SmolLM2-135M layer's products and the LM head at decode batch sizes, per kernel: float32 row- and
   column-major, bf16 and int8 (`--quantization bf16|int8`: our W8A32, also with a GGUF's 16-value blocks, which
   it keeps in 4-bit codes; oneDNN's W8A8), and torch's int8 weight-only and int4
   (GGUF Q4_1-sized groups of 32) kernels, which the engine does not offer because of these figures;
   then the whole model's products per kernel with every layer's own weights, read from memory as in a decode
   step (one layer's weights stay in the caches, which favours some kernels: on a 2-core Intel Xeon MKL's
   column-major product beat oneDNN's at one row from memory, and lost from two rows on);
4. the engine's decode throughput per path (transformers' forward, the lean forward in float32, bf16, int8, and
   int8 with every code in 8 bits where the engine keeps some in 4), interleaved --rounds times, with whether each
   path's greedy tokens equal float32's.

    .venv/bin/python bench/cpu_layout.py
    .venv/bin/python bench/cpu_layout.py --rounds 3 --streams 1 8 32 --output-len 32
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from enginecore.cpu_int8 import PackedInt8Linear, sixteen_values  # noqa: E402
from enginecore.cpu_linear import (Bf16Linear, Float32Linear, OneDnnFloat32Linear,  # noqa: E402
                                   bf16_unavailable_reason, native_bf16)
from enginecore.cpu_setup import (auto_choice, float32_layout, int8_kernels, int8_unavailable_reason,  # noqa: E402
                                  product_shapes, with_cpu_kernels)
from enginecore.cpu_threads import set_cpu_threads  # noqa: E402
from enginecore.engine import EngineCore  # noqa: E402
from enginecore.lean_model import LeanLlama  # noqa: E402
from enginecore.loader import load_model  # noqa: E402
from ipc.config import ServeConfig  # noqa: E402
from ipc.messages import EngineRequest  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3, help="interleaved engine runs per path")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slow-kernels", action="store_true",
                   help="also time torch's int8 weight-only and int4 kernels at every batch size (slow)")
    return p.parse_args()


def cpu_description() -> str:
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    blas = next((line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel" in line), "BLAS ?")
    return (f"{model}, {os.cpu_count()} cores; {' '.join(have) or 'no AVX2'}; torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}), {blas}")


def best_seconds(fn, repeat: int = 5, number: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - started) / number)
    return best


def bandwidth_and_ceilings(model: torch.nn.Module) -> None:
    data = torch.ones(128 * 2**20)
    bandwidth = data.numel() * 4 / best_seconds(data.sum, repeat=3, number=3)
    params = sum(p.numel() for p in model.parameters())
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s (best sum over 512 MB, {torch.get_num_threads()} "
          f"threads); {params / 1e6:.0f}M weights read once per token tops one stream out near "
          f"{bandwidth / (4 * params):.0f} tok/s in float32, {bandwidth / params:.0f} in int8")


def _engine_kernels() -> dict:
    """The engine's kernels that run here, by name: weight -> kernel."""
    kinds = {"f32 row": lambda w: Float32Linear(w, False), "f32 col": lambda w: Float32Linear(w, True),
             "f32 onednn": OneDnnFloat32Linear}
    if bf16_unavailable_reason() is None:
        kinds["bf16"] = Bf16Linear
    # int8's kernels where they multiply right (where one runs but is wrong, its time means nothing)
    kinds.update({f"int8 {name}": kernel for name, kernel in int8_kernels().items()})
    if "W8A32 (ours)" in int8_kernels():  # ours on a GGUF's Q4_1 blocks, as the embedded model's layers are
        gen = torch.Generator().manual_seed(0)
        kinds["int8 ours, 4-bit codes"] = lambda w: PackedInt8Linear(sixteen_values(*w.shape, gen))
    return kinds


def _kernels(weight: torch.Tensor, rows: int, slow: bool) -> dict:
    kernels = {name: make(weight) for name, make in _engine_kernels().items()}
    if slow or rows == 1:
        scale = weight.abs().amax(1) / 127
        q = (weight / scale[:, None]).round().to(torch.int8)
        kernels["torch int8 w-only"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)
        try:
            codes = torch.randint(0, 16, weight.shape, dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scales = torch.rand(weight.shape[1] // 32, weight.shape[0], 2)
            kernels["torch int4 g32"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
        except (RuntimeError, AttributeError):
            pass
    return kernels


def products(model: torch.nn.Module, batch_sizes: list[int], slow: bool) -> None:
    shapes = product_shapes(model)
    print(f"\none layer's products {shapes[:-1]} + the LM head {shapes[-1]}, (in, out); microseconds, best of 5")
    for rows in batch_sizes:
        totals: dict[str, list[float]] = {}
        for i, (fan_in, fan_out) in enumerate(shapes):
            weight = torch.randn(fan_out, fan_in) * 0.05
            x = torch.randn(rows, fan_in)
            for name, kernel in _kernels(weight, rows, slow).items():
                totals.setdefault(name, [0.0, 0.0])[i == len(shapes) - 1] += best_seconds(lambda k=kernel: k(x))
        cells = "  ".join(f"{name} {layer * 1e6:.0f} + {head * 1e6:.0f}" for name, (layer, head) in totals.items())
        print(f"{rows:>3} rows: {cells}")


def products_from_memory(model: torch.nn.Module, batch_sizes: list[int]) -> None:
    """The whole model's products at each batch size, every layer with weights of its own: what a decode step
    reads from memory, where the table above (one layer, best of 5) runs from the caches. One kernel kind's
    weights at a time."""
    shapes = product_shapes(model)
    layers = model.config.num_hidden_layers
    print(f"\nthe model's products from memory ({layers} layers' own weights + the LM head), ms a step, best of 3")
    times: dict[str, list[float]] = {}
    for name, make in _engine_kernels().items():
        shapes_of_step = [shape for _ in range(layers) for shape in shapes[:-1]] + shapes[-1:]
        kernels = [make(torch.randn(fan_out, fan_in) * 0.05) for fan_in, fan_out in shapes_of_step]
        times[name] = [_step_seconds(kernels, rows) for rows in batch_sizes]
    for i, rows in enumerate(batch_sizes):
        print(f"{rows:>3} rows: " + "  ".join(f"{name} {t[i] * 1e3:.1f}" for name, t in times.items()))


def _step_seconds(kernels: list, rows: int) -> float:
    xs = {k.in_features: torch.randn(rows, k.in_features) for k in kernels}
    return best_seconds(lambda: [k(xs[k.in_features]) for k in kernels], repeat=3, number=1)


def engine_paths(loaded, streams_list: list[int], rounds: int, output_len: int) -> None:
    unavailable = {"bf16": bf16_unavailable_reason(), "int8": int8_unavailable_reason()}
    for mode, reason in unavailable.items():
        if reason:
            print(f"(no {mode} path: {reason})")
    modes = ["none"] + [mode for mode, reason in unavailable.items() if reason is None]
    cores = {q: EngineCore(ServeConfig(device="cpu", dtype="float32", quantization=q, max_num_seqs=64,
                                       max_model_len=256, enable_prefix_caching=False), loaded=loaded)
             for q in modes}
    lean = cores["none"].runner.lean_model
    paths = {"transformers f32": ("none", None), "lean f32": ("none", lean)}
    paths.update({f"lean {q}": (q, cores[q].runner.lean_model) for q in modes if q != "none"})
    eight_bits = lean_with_8_bit_codes(loaded.model, cores.get("int8"))
    if eight_bits is not None:
        paths["lean int8, 8-bit codes"] = ("int8", eight_bits)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    print(f"\nengine decode, out tok/s (prompts of 32 tokens + {output_len} out, median of {rounds} interleaved "
          f"rounds); 'same' = greedy tokens equal to the transformers float32 path")
    for streams in streams_list:
        prompts = torch.randint(100, 30000, (streams, 32), generator=gen).tolist()
        rates: dict[str, list[float]] = {p: [] for p in paths}
        outputs: dict[str, list] = {}
        for r in range(rounds):
            for path, (quantization, lean_model) in paths.items():
                core = cores[quantization]
                if lean_model is not None or quantization == "none":
                    core.runner.lean_model = lean_model
                started = time.perf_counter()
                out = core.generate([EngineRequest(f"{r}-{i}", p, params) for i, p in enumerate(prompts)])
                rates[path].append(streams * output_len / (time.perf_counter() - started))
                outputs[path] = [out[(f"{r}-{i}", 0)] for i in range(streams)]
        cores["none"].runner.lean_model = lean
        if "int8" in cores:
            cores["int8"].runner.lean_model = paths["lean int8"][1]
        cells = "  ".join(f"{p} {statistics.median(v):.1f} ({'same' if outputs[p] == outputs['transformers f32'] else 'differs'})"
                          for p, v in rates.items())
        print(f"{streams:>3} streams: {cells}")


def lean_with_8_bit_codes(model: torch.nn.Module, int8_core: EngineCore | None) -> LeanLlama | None:
    """The int8 engine's lean forward with every product's codes in 8 bits, where it keeps some in 4 (the same
    codes, so the same tokens: what the 4-bit codes save, side by side); None where it keeps none in 4."""
    lean = int8_core.runner.lean_model if int8_core is not None else None
    if lean is None or not any(getattr(k, "bits", 8) == 4 for k in lean.linears()):
        return None
    eight = with_cpu_kernels(LeanLlama(model, functools.partial(PackedInt8Linear, bits=8)))
    eight.quantization = lean.quantization
    return eight


def main() -> None:
    args = parse_args()
    loaded = load_model(None, "cpu", "float32")
    print(cpu_description())
    print(f"threads: {set_cpu_threads()}, OpenMP waits {os.environ.get('OMP_WAIT_POLICY')} (the engine's defaults; "
          f"OMP_NUM_THREADS and OMP_WAIT_POLICY override them)")
    layout = float32_layout(loaded.model)
    print(f"float32 kernel chosen: {layout['kernel']} ({layout['why']})")
    mode, why = auto_choice(loaded.model, layout)
    print(f"--quantization auto chooses {mode} for the embedded GGUF here (native bfloat16: {native_bf16()}; the "
          f"most accurate mode 10% faster than float32: our int8, then bf16, then oneDNN's int8): {why}")
    bandwidth_and_ceilings(loaded.model)
    products(loaded.model, args.batch_sizes, args.slow_kernels)
    products_from_memory(loaded.model, args.batch_sizes)
    engine_paths(loaded, args.streams, args.rounds, args.output_len)


if __name__ == "__main__":
    main()
