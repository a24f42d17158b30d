"""The garbage collector once a process has started: what start-up made is frozen, and (in API servers) young
objects are collected less often.

CPython's cyclic collector walks every container object of a generation each time it runs: the youngest after every
700 allocations (net of frees), all of them every so often. An API server's start-up leaves some 49,000 behind
(modules, the tokenizer's tables, the chat template, pydantic's validators; a full collection 16 ms) that live as
long as the process, and each request makes some thousands that die young, nearly all freed by their reference
counts, not by the collector: in a profile of 1-token chat completions (perf, 2-core Intel Xeon VM) the collector
took about 8% of an API server's CPU. An engine core's start-up leaves some 376,000 (torch, transformers, the
model): a full collection took 155 ms there, a pause of the step thread's loop whenever enough survivors had piled
up. Frozen, start-up's objects are never walked again. An API server also collects young objects every
GEN0_THRESHOLD allocations: most are gone before a collection would have walked them. An engine core keeps
CPython's threshold: cyclic garbage there may hold device tensors, which should not wait longer to be freed, and
its young collections were not measured. bench/paced_pair.py --requests side by side: b/a 1.095 and 1.120 (medians
of two runs of 7 rounds), an API server's CPU per 1-token request 9-11% lower."""
from __future__ import annotations

import gc

# Allocations (net of frees) between two collections of the youngest generation (CPython: 700). Cyclic garbage
# waits that much longer: a few MB of objects at most.
GEN0_THRESHOLD = 20_000


def freeze_start_up(young_threshold: int | None = GEN0_THRESHOLD) -> None:
    """Call once start-up is done, before serving; `young_threshold` None keeps CPython's."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
