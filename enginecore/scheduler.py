"""Scheduler: which sequences run in the next step, and how many of their tokens.

Continuous batching under a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
running sequences first (decodes, then the rest of prompts being prefilled in chunks), then new prompts from the
waiting queue, the last one cut to what is left of the budget (chunked prefill). While other sequences run or
wait, one prompt's chunk takes at most `long_prefill_tokens` of a step (vLLM's long-prefill threshold): a long
prompt took the whole budget step after step, and a one-line chat that came after it waited for its whole prefill
(40 s behind 8,000 tokens on a 2-core CPU); alone, it takes the whole budget. And while a request waits (with a
free slot), the prompts already being prefilled leave it one such chunk of the step: four long prompts at
a quarter each filled every step between them, and the chat behind them waited 47-67 s. When the KV pool runs out of
blocks the newest, lowest-priority running sequence is preempted: its blocks are freed and it goes back to the
waiting queue to be recomputed later (prompt and generated tokens alike), so no request is ever lost. Under the
priority policy a waiting request also preempts a running one of a worse priority when there is no room for it
(no sequence slot or no blocks), as vLLM's priority scheduling does.

Order everywhere is Sequence.key: priority, then the fair share's turn, then arrival. The fair share keeps one
request from holding every slot. The scheduler's clock counts the sequences that have started to run; a request
takes its turn at the clock when it comes, and its k-th sequence (its choices, and the prompts of one API request:
EngineRequest.ordinal) k turns later, as if it had come k sequences later. So the 32,768 sequences of a request of
256 prompts with n=128 take turns with the requests that come after it instead of all running before them, and
since the clock moves with every sequence started, its last ones are not put off for ever by requests that keep
coming. Requests of one sequence keep their arrival order; with the fcfs policy every priority is 0.

A request's other choices are forked when its prompt is computed and run beside it while there are slots; the rest
wait for theirs like any sequence (--max-num-seqs holds for them too: the sampler and CUDA graphs are sized by it).
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from enginecore.block_pool import KVBlockPool
from enginecore.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    # (sequence, number of its tokens to compute this step); single-token entries come first.
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    # Copy-on-write: (source block, destination block) copies to make before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(self, pool: KVBlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_tokens: int = 0):
        """`long_prefill_tokens`: the most tokens one prompt's chunk takes of a step while others run or wait
        (0: no such cap)."""
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens or max_num_batched_tokens
        self.running: list[Sequence] = []  # kept sorted by Sequence.key
        self._waiting: list[tuple[tuple, int, Sequence]] = []  # heap; finished entries are skipped lazily
        self.num_waiting = 0
        self.clock = 0  # the fair share's clock: how many sequences have started to run
        # Keep a few blocks free for the running sequences' next tokens before admitting a new prompt,
        # so admissions do not cause a preemption on the very next step.
        self._watermark = max(1, pool.num_blocks // 100)
        # Skip the pool for a decode that needs nothing of it (tests turn it off to compare the two paths).
        self.fast_decode = True

    # --- queue ----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request's first sequence: its turn (its ordinal so far) counts from the clock."""
        seq.turn += self.clock
        self._queue(seq)

    def add_running(self, seq: Sequence) -> None:
        """A choice forked from a running sequence: it runs at once, sharing its parent's blocks."""
        self._run(seq)

    def add_fork(self, seq: Sequence) -> None:
        """A choice forked when every slot is taken: it waits for one, holding no block (its prompt's blocks are
        found in the prefix cache when it starts, and it computes the rest)."""
        self.pool.free(seq)
        self._queue(seq)

    def full(self) -> bool:
        return len(self.running) >= self.max_num_seqs

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=_key)
        self.clock += 1

    def _queue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.key, seq.seq_id, seq))
        self.num_waiting += 1

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of the schedule and free its blocks (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1  # its heap entry is skipped when it comes up, or dropped by _compact_waiting
        seq.status = SequenceStatus.FINISHED
        self.pool.free(seq)
        if len(self._waiting) > 2 * self.num_waiting + _WAITING_SLACK:
            self._compact_waiting()

    def _compact_waiting(self) -> None:
        """Drop the heap's finished entries. An entry behind a head that cannot start (every slot taken, or under
        the priority policy behind better ones for as long as they keep coming) would otherwise stay, with its
        sequence and prompt, for as long as that lasts: requests aborted while they wait (clients that time out
        and retry) piled up without end. Run once finished entries outnumber the waiting ones: amortized O(1)."""
        self._waiting = [entry for entry in self._waiting if entry[2].status is SequenceStatus.WAITING]
        heapq.heapify(self._waiting)

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][2].status is not SequenceStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    # --- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # A prompt's chunk when others run or wait beside it (it leaves them part of the step); alone, the budget.
        chunk = self.long_prefill_tokens if len(self.running) + self.num_waiting > 1 else budget
        # What the running prompts' chunks leave to the waiting queue's first: one chunk, when the cap is on and
        # a waiting request could start (decodes are never held back by it).
        reserve = chunk if chunk < budget and self.num_waiting and not self.full() else 0
        scheduled: dict[Sequence, int] = {}
        # Decodes (one token) before the rest, each group in priority order.
        order: list[Sequence] = []
        rest: list[Sequence] = []
        for s in self.running:
            (order if len(s.token_ids) - s.num_computed_tokens == 1 else rest).append(s)
        order += rest
        block_size = self.pool.block_size
        ref_count = self.pool.ref_counts
        running = SequenceStatus.RUNNING
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not running:  # preempted by one before it in this loop
                continue
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) - computed, budget, chunk)
            if n > 1 and n > budget - reserve:  # a prompt's chunk, past what it leaves to a waiting request
                n = budget - reserve
                if n <= 0:
                    continue
            table = seq.block_table
            # Fast path of a decode: its token goes into its last block, which has room and which no other
            # sequence holds. The pool would find nothing to do (no new block, no copy), so it is not asked.
            if (n == 1 and self.fast_decode and computed // block_size == len(table) - 1
                    and ref_count[table[-1]] == 1):
                scheduled[seq] = 1
                budget -= 1
                continue
            while not self._reserve(seq, n, batch.block_copies):
                victim = self.running[-1]
                budget += self._preempt_lowest_running(scheduled)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled[seq] = n
                budget -= n

        while budget > 0:
            seq = self._peek_waiting()
            if seq is None:
                break
            if self.full():
                if not self._outranks_lowest_running(seq):
                    break
                budget += self._preempt_lowest_running(scheduled)
                continue
            if seq.num_computed_tokens == 0:
                self._use_prefix_cache(seq)
            n = min(seq.num_uncomputed_tokens, budget, chunk)
            if not self._reserve(seq, n, batch.block_copies, self._watermark if self.running else 0):
                self.pool.free(seq)  # give back the prefix hits too; it tries again (next step, or below)
                if not self._outranks_lowest_running(seq):
                    break
                budget += self._preempt_lowest_running(scheduled)
                continue
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            self._run(seq)
            scheduled[seq] = n
            budget -= n

        ones = [(s, n) for s, n in scheduled.items() if n == 1]
        batch.entries = ones + [(s, n) for s, n in scheduled.items() if n != 1]
        return batch

    def _outranks_lowest_running(self, seq: Sequence) -> bool:
        """A waiting sequence of a strictly better priority (lower value) than the last running one takes its
        place when there is no room for both. Only the priority counts, not arrival: two requests of the same
        priority never preempt each other, so the fcfs policy (every priority 0) never preempts for admission."""
        return bool(self.running) and seq.priority < self.running[-1].priority

    def _preempt_lowest_running(self, scheduled: dict[Sequence, int]) -> int:
        """Preempt the lowest-ranked running sequence; the token budget it had been given this step comes back."""
        victim = self.running[-1]
        self._preempt(victim)
        return scheduled.pop(victim, 0)

    def _reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]], keep_free: int = 0) -> bool:
        """Make sure seq's block table covers its next n tokens, none of them in a shared block."""
        if not self.pool.can_append(seq, n, keep_free):
            return False
        copies += self.pool.append(seq, n)
        return True

    def _use_prefix_cache(self, seq: Sequence) -> None:
        self.pool.lookup_prefix(seq)
        if seq.num_preemptions == 0:  # a recompute after preemption is not what the client's prompt hit
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_preemptions += 1
        log.debug("preempted %s (choice %d) after %d tokens", seq.request_id, seq.index, seq.num_tokens)
        self._queue(seq)  # at its turn still: ahead of those that came after it


# Finished entries the waiting heap may hold beyond as many as it has waiting ones, before it is compacted.
_WAITING_SLACK = 64


def _key(seq: Sequence):
    return seq.key
