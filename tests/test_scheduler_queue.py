"""Requests aborted while they wait are freed at once, with their prompts, even when the queue's head cannot start
(every slot taken by long requests): clients that time out and retry must not pile up memory in the engine."""
from __future__ import annotations

import gc
import weakref

from enginecore.block_pool import KVBlockPool
from enginecore.scheduler import Scheduler
from enginecore.sequence import Sequence
from ipc.sampling import SamplingParams

SAMPLING = SamplingParams(max_tokens=1000)


def _seq(seq_id: int, priority: int) -> Sequence:
    prompt = list(range(64))
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", client=None, index=0, token_ids=prompt,
                    num_prompt_tokens=len(prompt), sampling=SAMPLING, priority=priority, arrival=seq_id)


def test_requests_aborted_while_waiting_behind_a_blocked_head_are_freed():
    scheduler = Scheduler(KVBlockPool(64, 16), max_num_seqs=1, max_num_batched_tokens=256)
    running = _seq(0, priority=0)
    scheduler.add(running)
    scheduler.schedule()  # it runs, and holds the only slot
    head = _seq(1, priority=0)  # waits for that slot as long as it runs
    scheduler.add(head)
    abandoned = []
    for seq_id in range(2, 2002):  # queued behind the head, then given up by their clients
        seq = _seq(seq_id, priority=1)
        scheduler.add(seq)
        scheduler.schedule()
        scheduler.finish(seq)
        abandoned.append(weakref.ref(seq))
        del seq
    gc.collect()
    alive = sum(ref() is not None for ref in abandoned)
    assert alive <= 100, f"{alive} of 2,000 aborted requests are still held by the engine"
    assert scheduler.num_waiting == 1 and [s for s, _ in scheduler.schedule().entries] == [running]  # head waits on


def _prompt(seq_id: int, tokens: int) -> Sequence:
    prompt = list(range(tokens))
    return Sequence(seq_id=seq_id, request_id=f"p{seq_id}", client=None, index=0, token_ids=prompt,
                    num_prompt_tokens=len(prompt), sampling=SAMPLING, priority=0, arrival=seq_id)


def test_long_prompts_being_prefilled_together_leave_a_chunk_to_a_waiting_request():
    """Each long prompt's chunk is capped, but four of them at a quarter each filled every step, and a chat that
    came after them waited until one was done (47-67 s behind four prompts of 6,000 tokens on a 2-core CPU). The
    running prompts now leave one chunk to the waiting queue; without a waiting request they fill the step."""
    scheduler = Scheduler(KVBlockPool(4096, 16), max_num_seqs=8, max_num_batched_tokens=256, long_prefill_tokens=64)
    longs = [_prompt(i, 4000) for i in range(4)]
    for seq in longs:
        scheduler.add(seq)
    first = scheduler.schedule().entries
    assert sorted((s.request_id, n) for s, n in first) == [("p0", 64), ("p1", 64), ("p2", 64), ("p3", 64)]
    for seq, n in first:
        seq.num_computed_tokens += n
    scheduler.add(_prompt(4, 10))
    entries = scheduler.schedule().entries
    assert ("p4", 10) in [(s.request_id, n) for s, n in entries]
    assert sum(n for _, n in entries) <= 256
    full = Scheduler(KVBlockPool(4096, 16), max_num_seqs=4, max_num_batched_tokens=256, long_prefill_tokens=64)
    for seq in [_prompt(i, 4000) for i in range(5)]:  # the fifth waits for a slot: nothing is held back for it
        full.add(seq)
    assert sum(n for _, n in full.schedule().entries) == 256


def test_a_long_prompt_leaves_part_of_each_step_to_the_requests_after_it():
    """Alone, a long prompt's chunk is the whole budget; once another request waits, it takes at most
    long_prefill_tokens and the newcomer starts in the same step. It took every step's budget until its prefill
    was done: a one-line chat behind 8,000 tokens waited 40 s on a 2-core CPU."""
    scheduler = Scheduler(KVBlockPool(1024, 16), max_num_seqs=8, max_num_batched_tokens=256, long_prefill_tokens=64)
    long = _prompt(0, 4000)
    scheduler.add(long)
    assert [(s.request_id, n) for s, n in scheduler.schedule().entries] == [("p0", 256)]  # alone: all of it
    long.num_computed_tokens += 256
    short = _prompt(1, 10)
    scheduler.add(short)
    assert sorted((s.request_id, n) for s, n in scheduler.schedule().entries) == [("p0", 64), ("p1", 10)]
    uncapped = Scheduler(KVBlockPool(1024, 16), max_num_seqs=8, max_num_batched_tokens=256)
    for seq in (_prompt(2, 4000), _prompt(3, 10)):
        uncapped.add(seq)
    assert [(s.request_id, n) for s, n in uncapped.schedule().entries] == [("p2", 256)]  # (0: no cap, as before)
