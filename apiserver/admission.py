"""Group-wide admission limits (--max-num-queued-reqs, --max-num-queued-tokens), without a lock.

The limits hold for the whole group, not per API server: each server counts what it admitted in its own slot of
the group's shared memory, and the group's totals are the sums over the slots. To admit, a server first counts
the request into its own slot, then sums every slot, and takes its count back out if the sum is over a limit.
With sequentially consistent counters (ipc/shared_state.py) whichever of two racing servers counts itself in
last sees the other's count, so the group never admits more than the limit. The price: two racing requests may
each see the other and both be refused although one of them would have fit (a spurious 503, which a client
retries); never an over-admission. No lock means a server that dies at any step, even between counting in and
checking, wedges nobody: its counts vanish when the supervisor releases its slot.

Without limits nothing is counted.

Test hook, read once at start-up: SUPERVISE_TEST_ADMISSION_PAUSE=<seconds> makes `admit` log a line and sleep
(blocking this server) between counting the request in and checking the totals, so a test can kill a server in
the middle of an admission. Never set it in production.
"""
from __future__ import annotations

import logging
import os
import time

from apiserver.errors import Overloaded

log = logging.getLogger(__name__)

TEST_PAUSE_ENV = "SUPERVISE_TEST_ADMISSION_PAUSE"


class AdmissionControl:
    def __init__(self, group_state, slot: int, max_requests: int | None, max_tokens: int | None):
        self._state = group_state
        self._slot = slot
        self._max_requests = max_requests
        self._max_tokens = max_tokens
        self.enabled = max_requests is not None or max_tokens is not None
        self._test_pause = float(os.environ.get(TEST_PAUSE_ENV) or 0)

    def admit(self, num_tokens: int) -> None:
        """Count a request of `num_tokens` prompt tokens in, or raise Overloaded (503) if it does not fit."""
        if not self.enabled:
            return
        self._state.add_admitted(self._slot, 1, num_tokens)
        if self._test_pause:
            log.warning("test hook: pausing %.1f s inside admission", self._test_pause)
            time.sleep(self._test_pause)
        requests, tokens = self._state.admitted()
        if self._max_requests is not None and requests > self._max_requests:
            self._state.add_admitted(self._slot, -1, -num_tokens)
            raise Overloaded(
                f"The server is at its limit of {self._max_requests} queued requests; retry later.",
                code="too_many_requests",
            )
        if self._max_tokens is not None and tokens > self._max_tokens:
            self._state.add_admitted(self._slot, -1, -num_tokens)
            raise Overloaded(
                f"The server is at its limit of {self._max_tokens} queued prompt tokens; retry later.",
                code="too_many_tokens",
            )

    def release(self, num_tokens: int) -> None:
        if self.enabled:
            self._state.add_admitted(self._slot, -1, -num_tokens)
