"""Which engine a request goes to: the least loaded of those that can take it, local or remote alike.

The rule. A rank's load is the number of requests in flight there from every API server of the group: each
server counts its own per rank in its slot of the group's shared memory (one store per request sent or ended),
and the balancer sums the live slots, so the count is exact and current whichever server sends. Ties go to the
rank whose engine last reported fewer waiting requests, then a lower KV cache usage, then round the ranks in turn
(so requests that come one at a time, all ties, still spread). What an engine reports (running, waiting, KV usage)
comes with every step's outputs to each API server that has requests in that step, and in the answer to every
server's liveness probe (each --engine-ping-interval): fresh where a server sends, up to one interval old
elsewhere, which is why it only breaks ties. Without the group's shared memory (a server alone), a rank's load is
what its engine last reported (running + waiting) plus what this server sent it since, never less than this
server's own requests there.

Engines that cannot take work are skipped: a rank marked down (its engine exited, its node went away) never gets
a request, and one whose last probe went unanswered gets one only if every other one is down or silent too.
"""
from __future__ import annotations

from ipc.shared_state import GroupState


class GroupInFlight:
    """The group's requests in flight per rank: this server's slot written here, every live slot summed."""

    def __init__(self, group: GroupState, slot: int):
        self.group = group
        self.slot = slot

    def add(self, rank: int, delta: int) -> None:
        self.group.add_in_flight_at(self.slot, rank, delta)

    def at(self, ranks: list[int]) -> list[int]:
        return self.group.in_flight_at(ranks)


class EngineLoads:
    """Per engine (by position in the client's list): what it reported, and the traffic to it."""

    def __init__(self, ranks: list[int], group: GroupInFlight | None = None):
        n = len(ranks)
        self.ranks = ranks
        self.group = group
        self.in_flight = [0] * n  # this server's requests there now
        self.running = [0] * n  # as last reported by the engine
        self.waiting = [0] * n
        self.kv_cache_usage = [0.0] * n
        self.sent_since_report = [0] * n
        self._turn = 0  # the engine a tie goes to first, moved on after each choice

    def report(self, engine: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running[engine] = running
        self.waiting[engine] = waiting
        self.kv_cache_usage[engine] = kv_cache_usage
        self.sent_since_report[engine] = 0

    def sent(self, engine: int) -> None:
        self.in_flight[engine] += 1
        self.sent_since_report[engine] += 1
        self._turn = engine + 1
        if self.group is not None:
            self.group.add(self.ranks[engine], 1)

    def done(self, engine: int) -> None:
        self.in_flight[engine] -= 1
        if self.group is not None:
            self.group.add(self.ranks[engine], -1)

    def group_in_flight(self) -> list[int] | None:
        """Every engine's requests in flight from the whole group (None without the group's shared memory)."""
        return None if self.group is None else self.group.at(self.ranks)

    def least_loaded(self, usable: list[int], preferred: set[int]) -> int:
        """The engine to send to, among `usable` (not down), those in `preferred` (answering pings) first."""
        candidates = [e for e in usable if e in preferred] or usable
        counts = self.group_in_flight()
        n, turn = len(self.in_flight), self._turn
        return min(candidates, key=lambda e: (
            counts[e] if counts is not None else self._estimate(e), self.waiting[e], self.kv_cache_usage[e],
            (e - turn) % n,
        ))

    def _estimate(self, engine: int) -> int:
        reported = self.running[engine] + self.waiting[engine] + self.sent_since_report[engine]
        return max(reported, self.in_flight[engine])
