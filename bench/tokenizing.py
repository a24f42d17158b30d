"""What turning a new request's text into token ids costs an API server, against the Rust tokenizer's `encode`.

An API server renders and tokenizes every new prompt on its event loop, so a wave of new requests (a closed
loop's next batch, a burst) waits for all of it before the last one reaches the engine. For unique prompts of
random vocabulary words (bench/prompts.py), of English prose, and of the same prose typeset (curly quotes, an
accented word: the parts around those characters go to the tokenizer), per prompt: `tokenizers.Tokenizer.encode`
(what the API server did before its word cache), the renderer's `encode` with the word cache cold (a fresh
renderer: every word new) and warm (the words seen before, the texts not), and the whole chat render
(template + ids; before: the same renderer without the word cache) with the event-loop time a wave of 256 such chats takes. Every id list is checked against the tokenizer's.

    .venv/bin/python bench/tokenizing.py
    .venv/bin/python bench/tokenizing.py --words 32 128 1024 --tokenizer bench/models/llama-3.2-1b
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_info import machine_info  # noqa: E402
from prompts import RandomPrompts, embedded_tokenizer_dir  # noqa: E402

# The target: a warm renderer tokenizes unique plain ASCII prompts at least this many times faster than the
# tokenizer (and typeset ones faster at all).
TARGET_SPEEDUP = 3.0
WAVE = 256
_PROSE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "they agreed to fund the new library wing, but only if the city's contribution arrives before March. "
    "\"We can't wait forever,\" said the chair, who'd spent 12 years on the board. Costs rose 4.5% in 2024; "
    "the plan (version 3) lists 27 items, from roof repairs to new shelving.\n\n"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, nargs="+", default=[32, 128, 1024], help="prompt lengths in words")
    p.add_argument("--prompts", type=int, default=300, help="unique prompts per length")
    p.add_argument("--tokenizer", default=None, help="a model directory (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def prose_prompts(random_prompts: RandomPrompts, count: int, words: int) -> list[str]:
    """English text of about `words` words, each prompt unique (its sentences shuffled, a random word added)."""
    sentences = [s + "." for s in _PROSE.replace("\n\n", " ").split(". ") if s]
    out = []
    for _ in range(count):
        text: list[str] = []
        while len(text) < words:
            text += random_prompts.random.choice(sentences).split(" ") + [random_prompts.prompt(1)]
        out.append(" ".join(text[:words]))
    return out


def typeset(text: str) -> str:
    """The same prose as word processors write it: curly quotes and apostrophes, dashes, an accented word."""
    return (text.replace("can't", "can’t").replace("who'd", "who’d").replace("city's", "city’s")
            .replace('"We', "“We").replace('," said', ",” said").replace(" -- ", " — ").replace("library", "bibliothèque"))


def per_prompt_us(function, texts: list[str]) -> float:
    # CPU time, not wall time: all of it is this thread's own work, and on a shared VM the wall clock also
    # counts the time other tenants held the core.
    start = time.process_time()
    for text in texts:
        function(text)
    return (time.process_time() - start) / len(texts) * 1e6


def measure(directory: str, texts: list[str]) -> dict:
    from apiserver.renderer import Renderer, load_tokenizer

    renderer = Renderer(load_tokenizer(directory))
    tokenizer = renderer.tokenizer
    pieces = renderer._segments._cache  # whole texts seen before: cleared, so each one is new to it

    def ours(text: str) -> list[int]:
        return renderer.encode(text, add_special_tokens=False)

    expected = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    theirs = per_prompt_us(lambda t: tokenizer.encode(t, add_special_tokens=False), texts)
    cold = per_prompt_us(ours, texts)  # every word new to the cache
    pieces.clear()
    warm = per_prompt_us(ours, texts)  # the words seen, the texts not
    pieces.clear()
    if [ours(t) for t in texts] != expected:
        raise SystemExit("the renderer's ids differ from the tokenizer's")
    row = {"tokenizer_us": theirs, "cold_us": cold, "warm_us": warm, "speedup_warm": theirs / warm,
           "covered": renderer._segments.words is not None}
    if renderer.chat_template:
        chats = [[{"role": "user", "content": t}] for t in texts]
        before = Renderer(load_tokenizer(directory), word_cache=False)  # its piece cache alone, as before
        row["chat_before_us"] = per_prompt_us(before.render_chat, chats)
        pieces.clear()
        row["chat_us"] = per_prompt_us(renderer.render_chat, chats)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = args.tokenizer or embedded_tokenizer_dir()
    if directory is None:
        raise SystemExit("no tokenizer: run `make setup` or give --tokenizer DIR")
    random_prompts = RandomPrompts(directory, seed=args.seed)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from enginecore.model_source import dummy_model_dir

        directory = dummy_model_dir(directory)
    rows = []
    for words in args.words:
        for kind, texts in (("vocabulary", random_prompts.prompts(args.prompts, words)),
                            ("prose", prose_prompts(random_prompts, args.prompts, words)),
                            ("typeset", [typeset(t) for t in prose_prompts(random_prompts, args.prompts, words)])):
            rows.append({"words": words, "text": kind, **measure(directory, texts)})
    print(f"tokenizing unique prompts, {directory} ({machine_info()['cpu']})")
    print(f"{'words':>6} {'text':>10} {'tokenizer us':>13} {'cold us':>8} {'warm us':>8} {'warm x':>7} "
          f"{'chat before us':>15} {'chat us':>8} {'wave before ms':>15} {'wave ms':>8}")
    for r in rows:
        print(f"{r['words']:>6} {r['text']:>10} {r['tokenizer_us']:>13.1f} {r['cold_us']:>8.1f} {r['warm_us']:>8.1f} "
              f"{r['speedup_warm']:>6.1f}x {r.get('chat_before_us', 0):>15.1f} {r.get('chat_us', 0):>8.1f} "
              f"{r.get('chat_before_us', 0) * WAVE / 1e3:>15.1f} {r.get('chat_us', 0) * WAVE / 1e3:>8.1f}")
    worst = min(r["speedup_warm"] for r in rows if r["text"] != "typeset")
    typeset_worst = min(r["speedup_warm"] for r in rows if r["text"] == "typeset")
    print(f"warm word cache against the tokenizer, plain ASCII text: {worst:.1f}x at worst (target >= "
          f"{TARGET_SPEEDUP:.0f}x){'' if worst >= TARGET_SPEEDUP else '  MISSED'}; typeset text: {typeset_worst:.1f}x "
          f"(target > 1x){'' if typeset_worst > 1 else '  MISSED'}; wave = {WAVE} new chats on one event loop")
    if not rows[0]["covered"]:
        print("this tokenizer is not one the word cache covers: every prompt went to the tokenizer")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
