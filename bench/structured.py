"""The cost of structured outputs in the engine core: a batch of requests under a JSON schema against the same
requests without one, in one run, and the grammar compile times.

    .venv/bin/python bench/structured.py                      # CPU: 32 chat requests, 64 output tokens each

Both sides decode greedily and produce exactly --output-len tokens per request: the unconstrained ones with
ignore_eos, the constrained ones under a schema that cannot close that soon (a list of at least 16 people), so the
two batches do the same forward passes and differ only by the masks. Rounds alternate (json, plain, json, ...) and
the ratio is taken per round, so a noisy machine moves both sides alike. Also printed: where the constrained
step's extra time goes (filling the masks, applying them), and the compile times of the schema: in the API server
(grammar text and check), in the engine cold (the tokenizer's index, built once per engine, then the grammar) and
cached (a copy of the compiled matcher per sequence).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import enginecore  # noqa: E402,F401  (first: it sets the OpenMP wait policy before torch loads)
from enginecore import structured_output  # noqa: E402
from enginecore.grammar_compiler import GrammarCompiler  # noqa: E402
from enginecore.engine import EngineCore  # noqa: E402
from enginecore.loader import load_model  # noqa: E402
from ipc import grammar as grammars  # noqa: E402
from ipc.config import ServeConfig  # noqa: E402
from ipc.messages import EngineRequest  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 16,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = ["a football team", "a school class", "a book club", "a hospital ward", "a band", "a chess club",
          "a film crew", "a space station"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="json/plain pairs")
    p.add_argument("--device", default="cpu")
    return p.parse_args()


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    prompts = []
    for i in range(n):
        question = f"List the people of {TOPICS[i % len(TOPICS)]} number {i} as JSON, with name, age and city."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


class StepTimer:
    """Seconds spent in the engine's mask fill and mask apply, wrapped around the real methods."""

    def __init__(self, core: EngineCore):
        self.fill = self.apply = 0.0
        mask, apply = core.structured.mask, structured_output.TokenMask.apply

        def timed_mask(seqs):
            started = time.perf_counter()
            try:
                return mask(seqs)
            finally:
                self.fill += time.perf_counter() - started

        def timed_apply(token_mask, logits):
            started = time.perf_counter()
            try:
                return apply(token_mask, logits)
            finally:
                self.apply += time.perf_counter() - started

        core.structured.mask = timed_mask
        structured_output.TokenMask.apply = timed_apply


def run(core: EngineCore, prompts, output_len: int, grammar: str | None) -> tuple[int, float]:
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=grammar is None, grammar=grammar)
    requests = [EngineRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    out = core.generate(requests)
    elapsed = time.perf_counter() - started
    tokens = sum(len(t) for t in out.values())
    assert tokens == output_len * len(prompts), f"{tokens} tokens: a request ended early"
    return tokens, elapsed


def compile_times(model_dir: str, vocab_size: int, eos: tuple[int, ...]) -> dict[str, float]:
    times = {}
    started = time.perf_counter()
    grammar = grammars.json_schema_grammar(PEOPLE)
    grammars.check(grammar)
    times["API server: grammar text + check, first (llguidance loads)"] = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(20):
        grammars.check(grammars.json_schema_grammar(PEOPLE))
    times["API server: grammar text + check, per request"] = (time.perf_counter() - started) / 20
    compiler = GrammarCompiler(os.path.join(model_dir, "tokenizer.json"), vocab_size, eos)
    started = time.perf_counter()
    compiler._llg_tokenizer()
    times["engine: tokenizer index (first grammar of an engine)"] = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile(grammar)
    times["engine: compile, cold"] = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        compiler.compile(grammar).matcher.deep_copy()
    times["engine: cached (lookup + matcher copy)"] = (time.perf_counter() - started) / 100
    assert compiled.error is None
    return times


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    loaded = load_model(None, args.device, "auto")
    prompts = chat_prompts(loaded.model_dir, args.num_prompts)
    config = ServeConfig(device=args.device, max_num_seqs=args.num_prompts, max_model_len=512,
                         enable_prefix_caching=False)  # each round computes its prompts again, as the other does
    core = EngineCore(config, loaded=loaded)
    times = compile_times(loaded.model_dir, core.vocab_size, core.eos_token_ids)
    grammar = grammars.json_schema_grammar(PEOPLE)
    run(core, prompts[:4], 8, grammar)  # warm-up (and the engine's own compile)
    timer = StepTimer(core)
    ratios, json_rates, plain_rates = [], [], []
    for _ in range(args.rounds):
        tokens, json_secs = run(core, prompts, args.output_len, grammar)
        plain_tokens, plain_secs = run(core, prompts, args.output_len, None)
        json_rates.append(tokens / json_secs)
        plain_rates.append(plain_tokens / plain_secs)
        ratios.append(json_rates[-1] / plain_rates[-1])
    steps = args.rounds * args.output_len

    print(f"\n{args.num_prompts} chat requests x {args.output_len} output tokens, greedy, on {loaded.device}; "
          f"{args.rounds} rounds (median)")
    print(f"{'requests':<34}{'out tok/s':>12}")
    print(f"{'without a schema':<34}{statistics.median(plain_rates):>12.1f}")
    print(f"{'with a JSON schema':<34}{statistics.median(json_rates):>12.1f}")
    print(f"{'ratio (with / without)':<34}{statistics.median(ratios):>12.2f}   per round: "
          + ", ".join(f"{r:.2f}" for r in ratios))
    print(f"per constrained step ({args.num_prompts} rows): masks filled in {timer.fill / steps * 1e3:.2f} ms, "
          f"applied in {timer.apply / steps * 1e3:.2f} ms")
    print(f"\ncompile times of the schema ({len(grammar)} characters of grammar):")
    for name, secs in times.items():
        print(f"  {name:<56}{secs * 1e3:>9.3f} ms")


if __name__ == "__main__":
    main()
