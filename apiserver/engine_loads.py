"""Which engine a request goes to: the least loaded of those that can take it, local or remote alike.

The rule. An engine's load, as this API server sees it, is
    running + waiting, as the engine last reported them, + the requests this server sent it since that report,
and never less than this server's own requests in flight there. Ties go to the engine with the lower KV cache
usage, then round the ranks in turn (so requests that come one at a time, all ties, still spread). An engine reports (running, waiting, KV usage) with every step's outputs to each API
server that has requests in that step, and answers every API server's liveness probe (each
--engine-ping-interval) with the same figures, so a server's view of an engine it sends nothing to is at most
one interval old. Counting what was sent since the report keeps a burst of requests from piling onto the engine
that looked idlest a moment ago; the floor keeps a stale report from hiding this server's own requests.

Engines that cannot take work are skipped: a rank marked down (its engine exited, its node went away) never gets
a request, and one whose last ping went unanswered gets one only if every other one is down or silent too.
"""
from __future__ import annotations


class EngineLoads:
    """Per engine (by position in the client's list): what it reported, and this server's traffic to it."""

    def __init__(self, num_engines: int):
        n = num_engines
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

    def done(self, engine: int) -> None:
        self.in_flight[engine] -= 1

    def load(self, engine: int) -> int:
        estimate = self.running[engine] + self.waiting[engine] + self.sent_since_report[engine]
        return max(estimate, self.in_flight[engine])

    def least_loaded(self, usable: list[int], preferred: set[int]) -> int:
        """The engine to send to, among `usable` (not down), those in `preferred` (answering pings) first."""
        candidates = [e for e in usable if e in preferred] or usable
        n, turn = len(self.in_flight), self._turn
        return min(candidates, key=lambda e: (self.load(e), self.kv_cache_usage[e], (e - turn) % n))
