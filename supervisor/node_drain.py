"""A headless node told to stop (SIGTERM, `systemctl stop`): its ranks finish what they run before it leaves.

The node says DRAINING to the head every beat in place of HELLO (ipc/registration.py); the head marks its ranks
draining and the API servers send them no new request. Each request already sent runs to its end. The node asks
its engines for their `stats` every DRAIN_POLL seconds and leaves (LEAVING, then its engines stop) once every one
of them runs and holds nothing, or when --shutdown-timeout has passed, or at a second stop signal.

An engine's answer counts only if it was asked SETTLE seconds after the head acknowledged the drain: a request an
API server sent just before it saw the mark may still be on its way to the engine, and an idle answer asked
before it arrives would cut it off. A head that does not answer (gone, or restarting) is not waited for past
ACK_WAIT, nor at all when it was silent already: nobody sends new work then.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

DRAIN_POLL = 0.2
SETTLE = 0.5
ACK_WAIT = 2.0


class NodeDrain:
    def __init__(self, ranks: Iterable[int], timeout: float, head_silent: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.ranks = list(ranks)
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + timeout
        # Answers to stats asked from then on count.
        self.counts_from: float | None = self.started if head_silent else None

    def head_answered(self) -> None:
        if self.counts_from is None:
            self.counts_from = self.clock() + SETTLE

    def drained(self, stats: dict[int, tuple[float, dict]]) -> bool:
        """Whether every engine said it runs and holds nothing, asked late enough to count."""
        now = self.clock()
        if self.counts_from is None and now - self.started >= ACK_WAIT:
            self.counts_from = now
        if self.counts_from is None:
            return False
        return all(rank in stats and stats[rank][0] >= self.counts_from and _idle(stats[rank][1])
                   for rank in self.ranks)

    def timed_out(self) -> bool:
        return self.clock() >= self.deadline

    @staticmethod
    def unfinished(stats: dict[int, tuple[float, dict]]) -> int:
        """Requests the engines said they held at their latest answers."""
        return sum(answer.get("num_running", 0) + answer.get("num_waiting", 0) for _, answer in stats.values())


def _idle(answer: dict) -> bool:
    return answer.get("num_running", 1) == 0 and answer.get("num_waiting", 1) == 0 and answer.get("num_requests", 0) == 0
