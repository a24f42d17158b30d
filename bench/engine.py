"""Offline throughput of the engine core against plain transformers `generate`, same model, same prompts, one run.

    .venv/bin/python bench/engine.py                                   # CPU: 32 prompts of 128 + 128 tokens
    python3 bench/engine.py --model DIR --device cuda --num-prompts 256   # one H200: target >= 20,000 out tok/s
    python3 bench/engine.py --model bench/models/llama-3.1-8b --load-format dummy --device cuda --dtype bfloat16
    python3 bench/engine.py --num-prompts 256 --closed-loop 1024 ...   # also 1024 requests, 256 in flight at a time
    (bench/device.sh runs these with random weights: --load-format dummy on the SmolLM2-135M and Llama shapes)

Both sides get the same random prompts (all of --prompt-len tokens) and produce exactly --output-len tokens each,
greedily (the engine with ignore_eos, transformers with min_new_tokens). transformers runs them as static batches
of --hf-batch-size (default: all at once), the engine as continuous batching under its own limits. A single-stream
row (one request alone) is printed too unless --no-single. `--closed-loop N` adds a row of N requests kept
--max-num-seqs in flight (the load bench/serve.py's --max-concurrency puts on a served group, where nearly every
step holds some new request's prefill beside the decodes).

It also prints what the prefix cache's block key costs per full block: the SHA-256 digest chained over the parent
block's digest and the block's token ids, against Python's hash() of the same (the old key, cheap to collide on
purpose), and what decoding costs: an ADD record on the engine's I/O thread (its fields type-checked), a step's
OUTPUTS message on an API server. `--hash-only` prints these alone, without loading a model.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from enginecore.block_pool import hash_block  # noqa: E402
from enginecore import attention_plan  # noqa: E402
from enginecore.attention_plan import rope_note  # noqa: E402
from enginecore.engine import EngineCore  # noqa: E402
from enginecore.loader import load_model  # noqa: E402
from ipc import codec  # noqa: E402
from ipc.config import ServeConfig  # noqa: E402
from ipc.messages import EngineOutputs, EngineRequest, RequestOutput  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights built on the device from config.json")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: 8192 on CUDA (a GPU step of 8k tokens costs little more than of 2k), else 2048")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=ServeConfig.cuda_graph_max_tokens,
                   help="CUDA: the most tokens of a step with prompt tokens that replays a graph (0: decodes only)")
    p.add_argument("--attention-backend", choices=["auto", "flash", "triton"], default="auto",
                   help="CUDA: the kernel of a step's attention (supervise --attention-backend)")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="the engine's asynchronous scheduling (auto: on for CUDA, off on the CPU)")
    p.add_argument("--closed-loop", type=int, default=0, metavar="N",
                   help="also run N requests (--prompt-len + --output-len each, prompts reused) keeping "
                        "--max-num-seqs in flight, a new one as one ends: bench/serve.py's closed loop without the "
                        "API servers, so that an end-to-end run compares with the engine under the same load")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--no-hf", action="store_true", help="skip plain transformers")
    p.add_argument("--no-single", action="store_true", help="skip the single-stream rows")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (for the block key's cost)")
    p.add_argument("--hash-only", action="store_true", help="print the prefix-cache block key's cost only")
    return p.parse_args()


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 32000), (n, length), generator=g).tolist()


def run_engine(core: EngineCore, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"b{i}", p, sp) for i, p in enumerate(prompts)]
    _sync(core.device)
    started = time.perf_counter()
    out = core.generate(requests)
    _sync(core.device)
    elapsed = time.perf_counter() - started
    return sum(len(t) for t in out.values()), elapsed


def run_engine_closed_loop(core: EngineCore, prompts: list[list[int]], output_len: int, total: int,
                           concurrency: int, graph_tokens: int) -> tuple[int, float, str]:
    """`total` requests, `concurrency` in flight: each one that ends is replaced at once, as clients in a closed
    loop do, so prefills of new requests join the running decodes. Also returns what kinds of steps ran."""
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sent = tokens = 0
    kinds = {"decode-only": 0, f"with prompt tokens, at most {graph_tokens} in all": 0,
             f"with prompt tokens, more than {graph_tokens}": 0}
    names = list(kinds)
    schedule = core.scheduler.schedule

    def counted_schedule():
        batch = schedule()
        if batch:
            step_tokens = sum(n for _, n in batch.entries)
            kind = 0 if step_tokens == len(batch.entries) else (1 if step_tokens <= graph_tokens else 2)
            kinds[names[kind]] += 1
        return batch

    def send() -> None:
        nonlocal sent
        core.add_request(EngineRequest(f"c{sent}", prompts[sent % len(prompts)], sp))
        sent += 1

    graph_steps = core.step_counts.graph_steps
    core.scheduler.schedule = counted_schedule
    _sync(core.device)
    started = time.perf_counter()
    while sent < min(concurrency, total):
        send()
    while core.has_work():
        for _, out in core.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None and sent < total:
                send()
    _sync(core.device)
    elapsed = time.perf_counter() - started
    core.scheduler.schedule = schedule
    mix = (f"closed loop: {sum(kinds.values())} steps: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
           + f"; {core.step_counts.graph_steps - graph_steps} replayed from CUDA graphs")
    return tokens, elapsed, mix


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], output_len: int, batch_size: int, device) -> tuple[int, float]:
    total = 0
    _sync(device)
    started = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i:i + batch_size], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    _sync(device)
    return total, time.perf_counter() - started


def block_key_cost(block_size: int, num_blocks: int = 50_000) -> tuple[float, float]:
    """Microseconds per full block of a chained prefix key: (SHA-256 digest, Python hash()), best of 3."""
    blocks = torch.randint(0, 49152, (num_blocks, block_size), generator=torch.Generator().manual_seed(0)).tolist()

    def sha256_chain():
        parent = None
        for tokens in blocks:
            parent = hash_block(parent, tokens)

    def python_hash_chain():
        parent = None
        for tokens in blocks:
            parent = hash((parent, tuple(tokens)))

    def best(chain) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            chain()
            times.append(time.perf_counter() - started)
        return min(times) / num_blocks * 1e6

    return best(sha256_chain), best(python_hash_chain)


def print_block_key_cost(block_size: int) -> None:
    sha, plain = block_key_cost(block_size)
    print(f"prefix-cache block key ({block_size} tokens): SHA-256 chained {sha:.2f} us per block, "
          f"Python hash() {plain:.2f} us ({sha / plain:.1f}x); per token {sha / block_size * 1000:.0f} ns")


def print_ipc_costs() -> None:
    """Microseconds to decode an ADD record on the engine's I/O thread (its fields type-checked, as every record from
    the network is: ipc/typecheck.py), for a short and a long prompt, and an OUTPUTS message of one token for each of
    256 streams on an API server (its cost every engine step). Best of 3. A wave of new requests costs the engine
    that many ADDs, under the GIL the step thread needs too."""
    figures = []
    for tokens in (128, 8192):
        request = EngineRequest("chatcmpl-0", list(range(1000, 1000 + tokens)), SamplingParams(max_tokens=128), 0)
        figures.append(f"{_decode_us(request):.1f} us for {tokens} prompt tokens")
    print("an ADD record decoded and checked: " + ", ".join(figures))
    outputs = EngineOutputs([RequestOutput(f"chatcmpl-{i}-0123456789abcdef", [1234]) for i in range(256)], 256)
    print(f"an OUTPUTS message of 256 one-token outputs decoded (API server): {_decode_us(outputs):.1f} us")


def _decode_us(record, repeats: int = 200) -> float:
    frames = [bytes(f) for f in codec.encode(record)]
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            codec.decode(frames)
        times.append((time.perf_counter() - started) / repeats * 1e6)
    return min(times)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.hash_only:
        print_block_key_cost(args.block_size)
        print_ipc_costs()
        return
    loaded = load_model(args.model, args.device, args.dtype, attn_implementation="sdpa", load_format=args.load_format)
    model = loaded.model
    prompts = make_prompts(args.num_prompts, args.prompt_len, model.config.vocab_size)

    hf_results = {}
    if not args.no_hf:  # transformers first: the engine switches the model's attention to its own
        run_hf(model, prompts[:2], 4, 2, loaded.device)  # warm-up
        hf_results["batch"] = run_hf(model, prompts, args.output_len, args.hf_batch_size or len(prompts),
                                     loaded.device)
        if not args.no_single:
            hf_results["single"] = run_hf(model, prompts[:1], args.output_len, 1, loaded.device)

    token_budget = args.max_num_batched_tokens or (8192 if loaded.device.type == "cuda" else 2048)
    config = ServeConfig(
        model=args.model, device=str(loaded.device), dtype=args.dtype, load_format=args.load_format,
        max_num_seqs=args.max_num_seqs or len(prompts), max_num_batched_tokens=token_budget, kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens, async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        attention_backend=args.attention_backend,
        max_model_len=args.prompt_len + args.output_len + 16,
        enable_prefix_caching=False,  # random prompts share nothing; keep the comparison about the engine
    )
    core = EngineCore(config, loaded=loaded)
    run_engine(core, prompts[: min(4, len(prompts))], 8)  # warm-up (and CUDA graph capture)
    engine_results = {"batch": run_engine(core, prompts, args.output_len)}
    loop_mix = ""
    if args.closed_loop:
        tokens, seconds, loop_mix = run_engine_closed_loop(core, prompts, args.output_len, args.closed_loop,
                                                           config.max_num_seqs,
                                                           min(args.cuda_graph_max_tokens, token_budget))
        engine_results["closed"] = (tokens, seconds)
    if not args.no_single:
        engine_results["single"] = run_engine(core, prompts[:1], args.output_len)

    print()
    print(f"model {loaded.model_dir} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}), "
          f"torch threads {torch.get_num_threads()}")
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens each; engine: "
          f"max-num-batched-tokens {token_budget}"
          + (f", CUDA graphs {'off' if args.enforce_eager else 'on'} (steps with prompt tokens: up to "
             f"{args.cuda_graph_max_tokens} tokens)" if loaded.device.type == "cuda" else "")
          + f", async scheduling {'on' if core.async_scheduling else 'off'}, attention: "
          + attention_plan.describe(getattr(core.runner, "eager", core.runner).kernels) + rope_note(core))
    print(f"{'workload':<22}{'system':<26}{'out tokens':>11}{'seconds':>10}{'out tok/s':>12}{'ratio':>8}")
    rows = (("batch", f"{args.num_prompts} requests"), ("closed", f"{args.closed_loop} requests, loop"),
            ("single", "1 request"))
    for name, label in rows:
        if name not in engine_results:
            continue
        tokens, secs = engine_results[name]
        rate = tokens / secs
        hf = hf_results.get(name)
        if hf:
            hf_rate = hf[0] / hf[1]
            hf_name = "transformers generate" + (f" (bs {args.hf_batch_size})" if args.hf_batch_size else "")
            print(f"{label:<22}{hf_name:<26}{hf[0]:>11}{hf[1]:>10.2f}{hf_rate:>12.1f}{1.0:>8.2f}")
        ratio = f"{rate / (hf[0] / hf[1]):>8.2f}" if hf else f"{'':>8}"
        print(f"{label:<22}{'supervise engine core':<26}{tokens:>11}{secs:>10.2f}{rate:>12.1f}{ratio}")
    if loop_mix:
        print(loop_mix)
    print()
    print_block_key_cost(args.block_size)
    print_ipc_costs()


if __name__ == "__main__":
    main()
