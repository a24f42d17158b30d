"""Which kernel computes each kind of varlen step (enginecore.attention.VarlenKernels), decided once at start-up.

Two kernels compute a whole step in one call on CUDA in half precision: gather + flash (torch's flash varlen
kernel over every run's K/V gathered from the cache) and paged Triton (enginecore.paged_triton, which reads the
blocks where they lie). Each must first give the reference's result on this GPU, this torch build and this model's
head shapes; with --attention-backend auto, when both do, each kind of step (decode-only, with prompt tokens) takes
the one that was faster on a step of that kind timed here: the kernels' speeds depend on the GPU, the head shapes
and the builds, and a measurement on the machine itself settles what no default could.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable

import torch

from enginecore.attention import VarlenAttention, VarlenKernel, VarlenKernels, gathered_flash, varlen_reference
from enginecore.engine_base import BadEngineSetting

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flash", "triton")
NAMES = {"flash": "gather + flash", "triton": "paged Triton"}
# The timed steps: decodes of random contexts up to this many tokens, and a prompt chunk after as many cached.
TIMED_CONTEXT = 512
TIMED_CHUNK = 512
TIMED_RUNS = 10


@dataclass(frozen=True)
class Case:
    """A step on one layer's cache: runs as (new tokens, context length), each run's blocks in kv_blocks."""

    q: torch.Tensor
    layer_kv: torch.Tensor
    step: VarlenAttention
    scaling: float


def plan_varlen(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                backend: str = "auto", max_num_seqs: int = 256) -> VarlenKernels | None:
    """The kernels of varlen steps here, or None where none runs (the CPU, float32): attention then runs per
    sequence with SDPA. An explicit backend that cannot run here is an error."""
    if backend not in BACKENDS:
        raise BadEngineSetting(f"--attention-backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        if backend != "auto":
            raise BadEngineSetting(f"--attention-backend {backend} needs CUDA in half precision; this engine runs "
                                   f"on {device.type} in {str(dtype).removeprefix('torch.')}")
        return None
    return choose((device, dtype, heads, kv_heads, head_dim), backend, max_num_seqs)


# (device, dtype, heads, kv_heads, head_dim): what a kernel is checked and timed on.
Shapes = tuple[torch.device, torch.dtype, int, int, int]


def choose(shapes: Shapes, backend: str, max_num_seqs: int) -> VarlenKernels | None:
    """plan_varlen's choice where a varlen kernel may run: shapes = (device, dtype, heads, kv_heads, head_dim)."""
    working: dict[str, VarlenKernel] = {}
    for name in (BACKENDS[1:] if backend == "auto" else (backend,)):
        kernel, why_not = kernel_named(name)
        if kernel is not None:
            why_not = kernel_fails(kernel, *shapes)
        if kernel is not None and why_not is None:
            working[name] = kernel
        elif backend != "auto":
            raise BadEngineSetting(f"--attention-backend {backend}: {NAMES[name]} attention does not run here "
                                   f"({why_not})")
        else:
            log.info("attention: %s does not run here (%s)", NAMES[name], why_not)
    if not working:
        log.info("attention: SDPA per sequence")
        return None
    decodes = dict(working)
    if "triton" in working:  # the paged kernel's other decode tiles, each checked as the default one was
        decodes.update(_paged_tiles(shapes))
    return VarlenKernels(
        decodes=_fastest(decodes, lambda: decode_case(*shapes, runs=min(max_num_seqs, 256)), "decode-only steps"),
        mixed=_fastest(working, lambda: mixed_case(*shapes, decodes=min(max_num_seqs, 64) - 1),
                       "steps with prompt tokens"))


def plan_rope_store(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                    head_dim: int) -> Callable | None:
    """enginecore.rope_triton.rope_store where it gives exactly the torch ops' results here (the lean forward then
    rotates q and k and writes K/V in one kernel a layer); None elsewhere (the CPU, float32, no Triton)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from enginecore import rope_triton
    except Exception as exc:  # no Triton
        why_not: str | None = _failure(exc)
    else:
        why_not = rope_store_fails(device, dtype, heads, kv_heads, head_dim)
    if why_not is not None:
        log.info("RoPE and the K/V cache write: torch's ops (the Triton kernel does not run here: %s)", why_not)
        return None
    log.info("RoPE and the K/V cache write: one Triton kernel a layer")
    return rope_triton.rope_store


def _paged_tiles(shapes: Shapes) -> dict[str, VarlenKernel]:
    """The paged kernel with each of its other decode tiles that passes the reference check (named by tile)."""
    from enginecore import paged_triton

    tiles = {}
    for tile in paged_triton.DECODE_TILES[1:]:
        kernel = paged_triton.paged_with(tile)
        why_not = kernel_fails(kernel, *shapes)
        if why_not is None:
            tiles[f"paged Triton, {paged_triton.tile_name(tile)}"] = kernel
        else:
            log.info("attention: paged Triton with %s does not run here (%s)", paged_triton.tile_name(tile), why_not)
    return tiles


def describe(kernels: VarlenKernels | None) -> str:
    """How this engine attends, for benchmarks' headers."""
    if kernels is None:
        return "SDPA per sequence"
    decodes, mixed = _name(kernels.decodes), _name(kernels.mixed)
    return decodes if decodes == mixed else f"{decodes} for decode-only steps, {mixed} for steps with prompt tokens"


def rope_note(core) -> str:
    """", RoPE + K/V write fused" where an engine core's lean forward runs enginecore.rope_triton (benchmarks)."""
    runner = getattr(core.runner, "eager", core.runner)
    return ", RoPE + K/V write fused" if getattr(runner.lean_model, "rope_store", None) is not None else ""


def _name(kernel: VarlenKernel) -> str:
    tile = getattr(kernel, "decode_tile", None)
    if tile is None:
        return NAMES["flash"]
    from enginecore.paged_triton import DECODE_TILES, tile_name

    return NAMES["triton"] + ("" if tile == DECODE_TILES[0] else f" ({tile_name(tile)} on decodes)")


def kernel_named(name: str) -> tuple[VarlenKernel | None, str | None]:
    """The kernel a backend names ("flash", "triton"), or why it cannot even be imported here."""
    if name == "flash":
        return gathered_flash, None
    try:
        from enginecore.paged_triton import paged
    except Exception as exc:  # no Triton, or one that cannot build for this GPU
        return None, _failure(exc)
    return paged, None


def kernel_fails(kernel: VarlenKernel, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int) -> str | None:
    """Why `kernel` does not compute what varlen_reference does here (None: it does), on steps that take each
    path a kernel may have: a decode beside a chunk after cached context; decodes of a CUDA graph (contexts padded
    to 32 blocks, the last row padding); two decodes of long contexts, few enough that a kernel splits the keys.
    On CUDA each is also replayed from a CUDA graph, as the engine's graphs run it."""
    g = torch.Generator(device=device).manual_seed(0)
    try:
        for runs, blocks in (([(1, 21), (3, 33)], None), ([(1, 300), (1, 37), (1, 1)], 32), ([(1, 700), (1, 1000)], None)):
            case = make_case(runs, device, dtype, heads, kv_heads, head_dim, g, blocks_per_run=blocks)
            want = reference(case).float()
            for got in _outputs(kernel, case):
                error = ((got.float() - want).norm() / want.norm()).item()
                if not error < 2e-2:  # bfloat16 lands near 4e-3
                    return f"{error:.2g} off the reference on contexts {[c for _, c in runs]}"
    except Exception as exc:  # no kernel in this build, for these shapes, or no seqused_k (older torch)
        return _failure(exc)
    return None


def _outputs(kernel: VarlenKernel, case: Case) -> list[torch.Tensor]:
    """The kernel's output on `case` called, and on CUDA also replayed from a graph that captured it."""
    call = lambda: kernel(case.q, case.layer_kv, case.step, case.scaling)  # noqa: E731
    return [call()] + ([_replayed(call)] if case.q.device.type == "cuda" else [])


def _replayed(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """call's output as a CUDA graph that captured it computes it: poisoned after the capture, then replayed."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    out.fill_(float("nan"))  # what the replay must overwrite
    graph.replay()
    return out


def _failure(exc: Exception) -> str:
    """An exception as one short line for the log (Triton's and torch's messages run to many lines)."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line[:160]}"


def rope_store_fails(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                     head_dim: int) -> str | None:
    """Why enginecore.rope_triton.rope_store does not give exactly what the torch ops give here (None: it does), on
    a step of 37 tokens in random slots; on CUDA also replayed from a CUDA graph that captured it."""
    try:
        from enginecore.rope_triton import reference, rope_store

        g = torch.Generator(device=device).manual_seed(0)
        tokens, slots_in_cache = 37, 200
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, generator=g)
        angles = torch.rand(tokens, 1, head_dim, device=device, generator=g) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        sin_signed = torch.cat([-sin[..., :head_dim // 2], sin[..., head_dim // 2:]], dim=-1)
        slots = torch.randperm(slots_in_cache, device=device, generator=g)[:tokens]
        k_cache, v_cache = (torch.randn(slots_in_cache, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
                            for _ in range(2))
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want = reference(qkv, cos, sin_signed, slots, want_k, want_v, heads, kv_heads)

        def differs(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> str | None:
            for what, got, expected in (("q", q, want), ("k", k_slots, want_k), ("v", v_slots, want_v)):
                if not torch.equal(got, expected):
                    return f"its {what} differs from the torch ops' by up to {(got - expected).abs().max().item():.3g}"
            return None

        k, v = k_cache.clone(), v_cache.clone()
        why = differs(rope_store(qkv, cos, sin_signed, slots, k, v, heads, kv_heads), k, v)
        if why is None and device.type == "cuda":
            k, v = k_cache.clone(), v_cache.clone()
            why = differs(_replayed(lambda: rope_store(qkv, cos, sin_signed, slots, k, v, heads, kv_heads)), k, v)
        return why
    except Exception as exc:  # no Triton kernel for this GPU or these shapes
        return _failure(exc)


def decode_case(device, dtype, heads: int, kv_heads: int, head_dim: int, runs: int) -> Case:
    rng = random.Random(1)
    return make_case([(1, rng.randrange(64, TIMED_CONTEXT)) for _ in range(runs)], device, dtype, heads, kv_heads,
                     head_dim, torch.Generator(device=device).manual_seed(1))


def mixed_case(device, dtype, heads: int, kv_heads: int, head_dim: int, decodes: int) -> Case:
    rng = random.Random(2)
    runs = [(1, rng.randrange(64, TIMED_CONTEXT)) for _ in range(decodes)] + [(TIMED_CHUNK, 2 * TIMED_CHUNK)]
    return make_case(runs, device, dtype, heads, kv_heads, head_dim, torch.Generator(device=device).manual_seed(2))


def make_case(runs: list[tuple[int, int]], device, dtype, heads: int, kv_heads: int, head_dim: int,
              g: torch.Generator, block_size: int = 16, blocks_per_run: int | None = None) -> Case:
    """Random q and cache; each run's blocks drawn at random from the cache (padded to blocks_per_run with the
    last block, as a CUDA graph's rows are)."""
    counts = [blocks_per_run or -(-context // block_size) for _, context in runs]
    num_blocks = sum(counts) + 1
    layer_kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(3)).tolist()
    blocks, taken = [], 0
    for (_, context), count in zip(runs, counts):
        used = -(-context // block_size)
        blocks += order[taken:taken + used] + [num_blocks - 1] * (count - used)
        taken += used
    ints = dict(device=device, dtype=torch.int32)
    step = VarlenAttention(
        kv_blocks=torch.tensor(blocks, device=device),
        cu_q=torch.tensor([0] + [n for n, _ in runs], **ints).cumsum(0, dtype=torch.int32),
        cu_k=torch.tensor([0] + [c * block_size for c in counts], **ints).cumsum(0, dtype=torch.int32),
        seqused_k=torch.tensor([c for _, c in runs], **ints),
        max_q=max(n for n, _ in runs), max_k=max(counts) * block_size)
    q = torch.randn(sum(n for n, _ in runs), heads, head_dim, device=device, dtype=dtype, generator=g)
    return Case(q, layer_kv, step, head_dim ** -0.5)


def reference(case: Case) -> torch.Tensor:
    s = case.step
    k, v = (case.layer_kv[i].index_select(0, s.kv_blocks).flatten(0, 1) for i in (0, 1))
    return varlen_reference(case.q.float(), k.float(), v.float(), s.cu_q, s.cu_k, s.seqused_k, s.max_q, s.max_k,
                            case.scaling)


def _fastest(kernels: dict[str, VarlenKernel], case: Callable[[], Case], kind: str) -> VarlenKernel:
    """Of `kernels` (by name: flash, triton, or paged Triton with another decode tile), the one that ran a step
    of `case` fastest; the only one without timing it."""
    if len(kernels) == 1:
        (kernel,) = kernels.values()
        log.info("attention for %s: %s", kind, _name(kernel))
        return kernel
    timed = case()
    times = {name: time_kernel(kernel, timed) for name, kernel in kernels.items()}
    best = min(times, key=lambda name: times[name])
    log.info("attention for %s: %s (a layer of %d runs: %s)", kind, _name(kernels[best]), len(timed.step.seqused_k),
             ", ".join(f"{NAMES.get(n, n)} {t * 1e3:.1f} us" for n, t in times.items()))
    return kernels[best]


def time_kernel(kernel: VarlenKernel, case: Case) -> float:
    """Milliseconds a call of `kernel` on `case` on the GPU (time_calls)."""
    return time_calls(lambda: kernel(case.q, case.layer_kv, case.step, case.scaling), case.q.device)


def time_calls(call: Callable[[], object], device: torch.device) -> float:
    """Milliseconds a call on the GPU: TIMED_RUNS calls captured in a CUDA graph, one replay timed with CUDA
    events, as the engine's graphs run them (eager calls would time the host's launches instead for small steps;
    where the capture fails, they are what is timed). Warmed up first: Triton compiles on its first call."""
    def calls() -> None:
        for _ in range(TIMED_RUNS):
            call()

    calls()
    torch.cuda.synchronize(device)
    runs = calls
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        runs = graph.replay
    except Exception:  # a kernel this build cannot capture: time it eagerly
        torch.cuda.synchronize(device)
    runs()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runs()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_RUNS
