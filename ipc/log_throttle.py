"""At most so many log lines a second from any one place in the code, so that a client cannot fill the disk.

Many lines are written per request on purpose (a 5xx with its reason, an engine's failed request) and some by
libraries (uvicorn's "Invalid HTTP request received." for every connection that sends garbage): a client that sends
thousands of bad requests a second would write thousands of lines a second, for as long as it likes. So each call
site (file and line) gets a bucket of BURST lines that refills at RATE lines a second: a burst is logged whole, a
flood at RATE. The lines dropped are counted, and the next line from that place says how many. Debug lines pass:
whoever turns them on wants them all; so do the access log's (UNTHROTTLED). The buckets are per call site, so
there are only as many as the code has logging calls.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

BURST = 20
RATE = 1.0  # lines a second, once a burst is spent
# Loggers whose every line was asked for: --access-log's (apiserver/access_log.py), one line per request, which the
# operator turned on knowing the volume. Throttled, it dropped most lines at 8 clients, and a client could hide
# its request behind 20 cheap ones.
UNTHROTTLED = frozenset({"apiserver.access"})


class _Bucket:
    __slots__ = ("tokens", "at", "dropped")

    def __init__(self, now: float):
        self.tokens = float(BURST)
        self.at = now
        self.dropped = 0


class LineThrottle(logging.Filter):
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._clock = clock
        self._buckets: dict[tuple[str, int], _Bucket] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or record.name in UNTHROTTLED:
            return True
        now = self._clock()
        site = (record.pathname, record.lineno)
        bucket = self._buckets.get(site)
        if bucket is None:
            bucket = self._buckets[site] = _Bucket(now)
        bucket.tokens = min(float(BURST), bucket.tokens + (now - bucket.at) * RATE)
        bucket.at = now
        if bucket.tokens < 1.0:
            bucket.dropped += 1
            return False
        bucket.tokens -= 1.0
        if bucket.dropped:
            record.msg = (f"{record.getMessage()} ({bucket.dropped} more from here not logged: at most {RATE:g} a "
                          f"second past a burst of {BURST})")
            record.args = None
            bucket.dropped = 0
        return True
