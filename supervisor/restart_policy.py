"""When to restart a dead API server, and when restarting has become pointless."""
from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    """At most `max_restarts` within `window` seconds; each restart inside the window waits twice as long as
    the one before (the first at once, so a lone crash costs clients nothing)."""

    FIRST_BACKOFF = 0.25
    MAX_BACKOFF = 8.0

    def __init__(self, max_restarts: int, window: float):
        self.max_restarts = max_restarts
        self.window = window
        self._recent: deque[float] = deque()

    def next_delay(self, now: float | None = None) -> float | None:
        """Seconds to wait before the next restart, or None when the budget is spent."""
        now = time.monotonic() if now is None else now
        while self._recent and now - self._recent[0] > self.window:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return None
        earlier = len(self._recent)
        self._recent.append(now)
        return 0.0 if earlier == 0 else min(self.FIRST_BACKOFF * 2 ** (earlier - 1), self.MAX_BACKOFF)
