"""Why the CPU engine stores Linear weights column-major, and what bounds a float32 decode step on this machine.

Three tables, each side by side in one run:
1. memory read bandwidth (a sum over a 512 MB tensor) and what it allows one float32 stream, which reads every
   weight once per token (a rough ceiling: the shared L3 cache may hold part of the weights);
2. every matrix product of one SmolLM2-135M decoder layer at decode batch sizes, weights row-major (as
   nn.Linear stores them) against column-major (as enginecore/cpu_weights.py lays them out);
3. the engine core's decode throughput with each layout, interleaved --rounds times on the embedded model.

    .venv/bin/python bench/cpu_layout.py
    .venv/bin/python bench/cpu_layout.py --rounds 6 --streams 32 --output-len 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
from enginecore.engine import EngineCore  # noqa: E402
from enginecore.loader import load_model  # noqa: E402
from ipc.config import ServeConfig  # noqa: E402
from ipc.messages import EngineRequest  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402

# (name, in, out) of one SmolLM2-135M decoder layer's products.
LAYER_PRODUCTS = [("q", 576, 576), ("k", 576, 192), ("v", 576, 192), ("o", 576, 576),
                  ("gate", 576, 1536), ("up", 576, 1536), ("down", 1536, 576)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=4, help="interleaved engine runs per layout")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    return p.parse_args()


def best_seconds(fn, repeat: int = 5, number: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - started) / number)
    return best


def memory_bandwidth() -> float:
    """Bytes per second, the best of a few sums over 512 MB of float32."""
    data = torch.ones(128 * 2**20)
    return data.numel() * 4 / best_seconds(data.sum, repeat=3, number=3)


def single_stream_ceiling(model: torch.nn.Module, bandwidth: float) -> None:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s (best sum over 512 MB, {torch.get_num_threads()} "
          f"threads); the model's weights: {weight_bytes / 1e6:.0f} MB, so one stream reading them all per token "
          f"tops out near {bandwidth / weight_bytes:.0f} tokens/s")


def layer_products(batch_sizes: list[int]) -> None:
    print(f"\n{'rows':>5}{'product':>9}{'row-major us':>14}{'col-major us':>14}{'ratio':>8}")
    for rows in batch_sizes:
        totals = [0.0, 0.0]
        for name, fan_in, fan_out in LAYER_PRODUCTS:
            x = torch.randn(rows, fan_in)
            weight = torch.randn(fan_out, fan_in)
            column_major = weight.t().contiguous().t()
            times = [best_seconds(lambda w=w: torch.nn.functional.linear(x, w)) for w in (weight, column_major)]
            totals = [t + s for t, s in zip(totals, times)]
            print(f"{rows:>5}{name:>9}{times[0] * 1e6:>14.0f}{times[1] * 1e6:>14.0f}{times[0] / times[1]:>8.2f}")
        print(f"{rows:>5}{'layer':>9}{totals[0] * 1e6:>14.0f}{totals[1] * 1e6:>14.0f}{totals[0] / totals[1]:>8.2f}")


def set_layout(model: torch.nn.Module, column_major: bool) -> None:
    """Re-lay the engine's Linear weights (the tied LM head stays row-major either way, as in the engine)."""
    tied = model.get_input_embeddings().weight.data_ptr()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() != tied:
            w = module.weight.data
            module.weight.data = w.t().contiguous().t() if column_major else w.contiguous()


def engine_decode(loaded, rounds: int, streams: int, output_len: int) -> None:
    core = EngineCore(ServeConfig(device="cpu", dtype="float32", max_num_seqs=max(streams, 1),
                                  max_model_len=256, enable_prefix_caching=False), loaded=loaded)
    prompts = torch.randint(100, 32000, (streams, 32), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    core.generate([EngineRequest("warm", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))])
    rates: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, dict] = {}
    for r in range(rounds):
        for column_major in (False, True):
            set_layout(loaded.model, column_major)
            started = time.perf_counter()
            out = core.generate([EngineRequest(f"{r}-{column_major}-{i}", p, params) for i, p in enumerate(prompts)])
            rates[column_major].append(streams * output_len / (time.perf_counter() - started))
            outputs[column_major] = sorted(tuple(t) for t in out.values())
    row, col = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"\nengine core, {streams} streams x ({len(prompts[0])} + {output_len}) tokens, median of {rounds} "
          f"interleaved rounds: row-major {row:.1f} out tok/s, column-major {col:.1f} ({col / row:.2f}x); "
          f"same greedy tokens: {outputs[False] == outputs[True]}")


def main() -> None:
    args = parse_args()
    loaded = load_model(None, "cpu", "float32")
    single_stream_ceiling(loaded.model, memory_bandwidth())
    layer_products(args.batch_sizes)
    engine_decode(loaded, args.rounds, args.streams, args.output_len)


if __name__ == "__main__":
    main()
