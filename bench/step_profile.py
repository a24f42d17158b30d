"""Where one decode step of the engine goes: host phases, GPU work and GPU idle, per step, at a full batch.

    python3 bench/step_profile.py --model .device/smollm2 --load-format dummy --device cuda --dtype bfloat16
    .venv/bin/python bench/step_profile.py --tiny      # the host side alone: a 2-layer, 64-wide model on the CPU

It admits --num-seqs requests of --prompt-len random tokens, steps until every one is decoding, then times
--steps decode steps. Each engine phase is timed on the host by wrapping its method (schedule, prepare inputs,
copy blocks, forward launch, structured mask, sampling launch, tokens to the host, emit per sequence, prefix-block
registration); on CUDA a second pass times each step's forward with events, and the rest of the wall time is the
GPU waiting for the host. "tokens to the host" includes waiting for the GPU. Under asynchronous scheduling the
host's phases of step k+1 overlap the GPU's work of step k, so the GPU idles only where the host takes longer.

--tiny shrinks the model (hidden 64, 2 layers, 2 heads) so the forward costs almost nothing: what is left is the
per-step host work that a GPU step of the real model pays too, measurable on any CPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from enginecore import attention_plan  # noqa: E402
from enginecore.attention_plan import rope_note  # noqa: E402
from enginecore.engine import EngineCore  # noqa: E402
from enginecore.sampler import SampledTokens  # noqa: E402
from ipc.config import ServeConfig  # noqa: E402
from ipc.messages import EngineRequest  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="the CPU's products: auto, none, bf16, int8")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--attention-backend", choices=["auto", "flash", "triton"], default="auto",
                   help="CUDA: the kernel of a step's attention (supervise --attention-backend)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="the engine's asynchronous scheduling (auto: on for CUDA, off on the CPU)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model with random weights")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also print the N operations that take most of 20 more steps (torch.profiler; on CUDA by GPU time)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    return p.parse_args()


def tiny_model_dir(source: str | None) -> str:
    """A copy of the model's config and tokenizer with TINY's shape: the dummy loader builds it."""
    from enginecore.model_source import resolve_model

    src = resolve_model(source)
    dst = tempfile.mkdtemp(prefix="tiny-model-")
    for name in os.listdir(src):
        if name.endswith((".json", ".jinja")):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(TINY)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


class PhaseTimer:
    """Wraps methods so that each call adds its host time to its phase's total."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, owner, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - started

        setattr(owner, method, timed)


def forward_gpu_ms(core: EngineCore, steps: int) -> float:
    """The GPU's time for one step's forward pass, mean over `steps` more steps: events around it, with the host
    waiting for each (so this pass's wall time means nothing)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    inner = core.runner.forward
    total = 0.0

    def timed(inputs):
        nonlocal total
        torch.cuda.synchronize()  # the step's input copies are done: the span is the forward's alone
        start.record()
        logits = inner(inputs)
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
        return logits

    core.runner.forward = timed
    for _ in range(steps):
        core.step()
    core.runner.forward = inner
    return total / steps


def top_kernels(core: EngineCore, n: int, steps: int = 5) -> str:
    """torch.profiler's table of the operations of `steps` steps, the n costliest by device time (on the CPU: by
    their own CPU time; the profiler's per-op overhead inflates the small ops there)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = core.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        if cuda:
            torch.cuda.synchronize()
    return f"{'GPU' if cuda else 'CPU'} operations over {steps} steps:\n" + prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=n, max_name_column_width=60)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model = tiny_model_dir(args.model) if args.tiny else args.model
    load_format = "dummy" if args.tiny else args.load_format
    steps = args.steps
    config = ServeConfig(model=model, device=args.device, dtype=args.dtype, load_format=load_format,
                         quantization=args.quantization, max_num_seqs=args.num_seqs, max_num_batched_tokens=8192,
                         enforce_eager=args.enforce_eager, max_model_len=args.prompt_len + 2 * steps + 64, enable_prefix_caching=False,
                         async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                         attention_backend=args.attention_backend)
    core = EngineCore(config)
    cuda = core.device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 32000, (args.num_seqs, args.prompt_len), generator=g).tolist()
    sampling = SamplingParams(max_tokens=2 * steps + 32, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"p{i}", prompt, sampling))
    # Prefill, then a few decode steps (CUDA graphs capture on first use).
    while any(s.num_output_tokens < 3 for s in core.scheduler.running) or core.scheduler.num_waiting:
        core.step()
    for _ in range(5):
        core.step()

    timer = PhaseTimer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.runner, "prepare", "prepare inputs")
    timer.wrap(core.kv_cache, "copy_blocks", "copy blocks")
    timer.wrap(core.runner, "forward", "forward (launch)")
    timer.wrap(core.structured, "mask", "structured mask")
    timer.wrap(core.sampler, "launch", "sample (launch)")
    timer.wrap(SampledTokens, "result", "tokens to the host (waits for the GPU)" if cuda else "tokens to the host")
    timer.wrap(core, "_emit", "emit")
    timer.wrap(core.pool, "register_full_blocks", "register blocks")
    timer.on = True
    wall, tokens = 0.0, 0
    for _ in range(steps):
        started = time.perf_counter()
        tokens += sum(len(out.new_token_ids) for _, out in core.step())
        wall += time.perf_counter() - started
    timer.on = False
    gpu_ms = forward_gpu_ms(core, steps) if cuda else None
    kernel_table = top_kernels(core, args.kernels, steps=20) if args.kernels else None

    per_step = wall / steps * 1e3
    print(f"model {core.loaded.model_dir} ({'tiny ' if args.tiny else ''}{core.quantization}) on {core.device}, "
          f"{args.num_seqs} sequences decoding, {steps} steps, async scheduling "
          f"{'on' if core.async_scheduling else 'off'}, attention: "
          f"{attention_plan.describe(getattr(core.runner, 'eager', core.runner).kernels)}"
          f"{rope_note(core)}")
    print(f"step: {per_step:.3f} ms wall, {tokens / wall:.0f} tokens/s, "
          f"{wall / max(tokens, 1) * 1e6:.2f} us per token")
    print(f"{'phase':<30}{'ms/step':>10}{'share':>8}{'us/seq':>9}")
    accounted = 0.0
    for phase, total in sorted(timer.totals.items(), key=lambda kv: -kv[1]):
        ms = total / steps * 1e3
        accounted += ms
        print(f"{phase:<30}{ms:>10.3f}{ms / per_step:>8.1%}{ms * 1e3 / args.num_seqs:>9.2f}")
    print(f"{'other (engine bookkeeping)':<30}{per_step - accounted:>10.3f}{(per_step - accounted) / per_step:>8.1%}")
    if gpu_ms is not None:
        print(f"GPU time of a step's forward (events, a second pass): {gpu_ms:.3f} ms, {gpu_ms / per_step:.1%} of "
              f"the wall: the GPU is idle {1 - gpu_ms / per_step:.1%} of a step, waiting for the host")
    if kernel_table:
        print(kernel_table)


if __name__ == "__main__":
    main()
