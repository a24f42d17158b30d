"""The scheduler's decode fast path (a decode whose token fits in its own last block skips the pool) must schedule
exactly as the pool's verbs would: same entries, same block copies, same block tables, same preemptions."""
from __future__ import annotations

import random

from enginecore.block_pool import KVBlockPool
from enginecore.scheduler import Scheduler
from enginecore.sequence import Sequence, SequenceStatus
from ipc.sampling import SamplingParams


def _run(fast: bool, seed: int, num_blocks: int, block_size: int = 4, steps: int = 200):
    """A random workload of prompts, forks and decodes on a small pool; the trace of every step, and how many
    times the pool's append ran."""
    rng = random.Random(seed)
    pool = KVBlockPool(num_blocks, block_size, enable_prefix_caching=True)
    appends = 0
    append = pool.append

    def counting_append(seq, n):
        nonlocal appends
        appends += 1
        return append(seq, n)

    pool.append = counting_append  # type: ignore[method-assign]
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=24)
    scheduler.fast_decode = fast
    sampling = SamplingParams(max_tokens=1000)
    seqs: list[Sequence] = []
    limits: dict[int, int] = {}
    shared = [rng.randrange(100) for _ in range(12)]  # a common prefix: prefix-cache hits share blocks
    trace = []
    next_id = 0

    def new_seq(tokens, index=0, arrival=None) -> Sequence:
        nonlocal next_id
        next_id += 1
        return Sequence(seq_id=next_id, request_id=f"r{next_id}", client=None, index=index, token_ids=tokens,
                        num_prompt_tokens=len(tokens), sampling=sampling, priority=rng.randrange(2),
                        arrival=next_id if arrival is None else arrival)

    for _ in range(steps):
        if rng.random() < 0.3:
            prompt = (shared[:rng.randrange(13)] if rng.random() < 0.5 else []) + \
                [rng.randrange(100) for _ in range(rng.randrange(1, 10))]
            seq = new_seq(prompt)
            limits[seq.seq_id] = min(len(prompt) + rng.randrange(1, 40), num_blocks * block_size)  # it fits alone
            scheduler.add(seq)
            seqs.append(seq)
        batch = scheduler.schedule()
        trace.append(([(s.seq_id, n) for s, n in batch.entries], list(batch.block_copies),
                      sorted((s.seq_id, s.status.value, tuple(s.block_table), s.num_computed_tokens)
                             for s in seqs)))
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            pool.register_full_blocks(seq)
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(rng.randrange(100))
                if len(seq.token_ids) >= limits[seq.seq_id]:
                    scheduler.finish(seq)
                elif rng.random() < 0.05 and len(scheduler.running) < scheduler.max_num_seqs:
                    # Another choice of the request: it shares every block of its parent, the partial last
                    # one too (copy-on-write on its next token).
                    child = seq.fork(next_id + 1, seq.index + 1, None)
                    next_id += 1
                    limits[child.seq_id] = limits[seq.seq_id]
                    pool.fork(seq, child)
                    scheduler.add_running(child)
                    seqs.append(child)
    assert any(s.status is SequenceStatus.FINISHED for s in seqs)
    return trace, appends


def test_decode_fast_path_schedules_as_the_pool_does():
    for seed in range(12):
        for num_blocks in (6, 12, 40):
            slow, slow_appends = _run(False, seed, num_blocks)
            fast, fast_appends = _run(True, seed, num_blocks)
            assert fast == slow, (seed, num_blocks)
            assert fast_appends < slow_appends  # the fast path was taken


def test_trace_covers_preemption_and_copy_on_write():
    """The workload above exercises what the fast path must not skip: preemptions and block copies."""
    copies = preempted = 0
    for seed in range(12):
        trace, _ = _run(False, seed, 6)
        copies += sum(len(step[1]) for step in trace)
        for before, after in zip(trace, trace[1:]):
            was_running = {s for s, status, *_ in before[2] if status == "running"}
            preempted += sum(1 for s, status, *_ in after[2] if status == "waiting" and s in was_running)
    assert copies > 0 and preempted > 0
