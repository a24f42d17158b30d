"""What each `--quantization` mode gives up against float32 and what it buys, on the embedded model, in one run.

Quality on the fixed prompt set of tests/agreement.py (8 chat prompts, 32 greedy tokens each): the share of
positions where the mode's most likely token is float32's greedy token (float32's continuation fed back), the
share where free-running greedy tokens are equal (one early difference shifts the rest), and the largest
per-prompt gap in mean per-token loglikelihood. Speed: decode tokens/s per mode, interleaved rounds.
tests/test_quantization.py bounds the quality figures (>= 90%, <= 0.15 nats).

    .venv/bin/python bench/quantization.py
    .venv/bin/python bench/quantization.py --streams 1 8 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import enginecore  # noqa: E402,F401  (first: OpenMP settings before torch loads)
import torch  # noqa: E402
from ipc.messages import EngineRequest  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402
from enginecore.cpu_linear import bf16_unavailable_reason  # noqa: E402
from enginecore.cpu_setup import int8_unavailable_reason  # noqa: E402
from tests.agreement import QUESTIONS, agreement, reference  # noqa: E402
from tests.test_engine_support import chat_prompt, make_engine  # noqa: E402

MODES = ("none", "bf16", "int8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()
    unavailable = {"bf16": bf16_unavailable_reason(), "int8": int8_unavailable_reason()}
    for mode, why in unavailable.items():
        if why:
            print(f"{mode}: cannot run here: {why}")
    engines = {mode: make_engine(quantization=mode) for mode in MODES if not unavailable.get(mode)}
    ref = reference(engines["none"], [chat_prompt(q) for q in QUESTIONS], max_tokens=32)
    print(f"{'mode':>6}{'teacher-forced':>16}{'free-running':>14}{'mean logprob':>14}{'max gap':>10}  (float32: "
          f"{sum(sum(e[0] for e in s) / len(s) for s in ref.scores) / len(ref.scores):.4f})")
    for mode in list(engines)[1:]:
        a = agreement(ref, engines[mode])
        print(f"{mode:>6}{a.teacher_forced:>16.1%}{a.free_running:>14.1%}{a.mean_logprob_other:>14.4f}"
              f"{a.max_prompt_logprob_gap:>10.4f}")
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    print(f"\ndecode out tok/s (32-token prompts + {args.output_len}), median of {args.rounds} interleaved rounds")
    for streams in args.streams:
        prompts = torch.randint(100, 30000, (streams, 32), generator=gen).tolist()
        rates: dict[str, list[float]] = {mode: [] for mode in engines}
        for r in range(args.rounds):
            for mode, engine in engines.items():
                started = time.perf_counter()
                engine.generate([EngineRequest(f"{r}-{i}", p, params) for i, p in enumerate(prompts)])
                rates[mode].append(streams * args.output_len / (time.perf_counter() - started))
        base = statistics.median(rates["none"])
        print(f"{streams:>3} streams: " + "  ".join(
            f"{mode} {statistics.median(v):.1f} ({statistics.median(v) / base:.2f}x)" for mode, v in rates.items()))


if __name__ == "__main__":
    main()
