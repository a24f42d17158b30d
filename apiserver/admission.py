"""Group-wide admission limits (--max-num-queued-reqs, --max-num-queued-tokens).

The limits hold for the whole group, not per API server: each server's admitted counts live in its slot of
the group's shared memory, and are summed and raised only under the group lock, so with 4 servers and a
limit of 10 never more than 10 requests are admitted at once. A server that dies frees its counts with its
slot. Without limits nothing is counted and the lock is never taken.
"""
from __future__ import annotations

from apiserver.errors import Overloaded


class AdmissionControl:
    def __init__(self, group_state, group_lock, slot: int, max_requests: int | None, max_tokens: int | None):
        self._group = group_state
        self._slot = slot
        self._lock = group_lock
        self._max_requests = max_requests
        self._max_tokens = max_tokens
        self.enabled = max_requests is not None or max_tokens is not None

    def admit(self, num_tokens: int) -> None:
        """Count a request of `num_tokens` prompt tokens in, or raise Overloaded (503) if it does not fit."""
        if not self.enabled:
            return
        with self._lock:
            requests, tokens = self._group.admitted()
            if self._max_requests is not None and requests + 1 > self._max_requests:
                raise Overloaded(
                    f"The server is at its limit of {self._max_requests} queued requests; retry later.",
                    code="too_many_requests",
                )
            if self._max_tokens is not None and tokens + num_tokens > self._max_tokens:
                raise Overloaded(
                    f"The server is at its limit of {self._max_tokens} queued prompt tokens; retry later.",
                    code="too_many_tokens",
                )
            self._group.add_admitted(self._slot, 1, num_tokens)

    def release(self, num_tokens: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._group.add_admitted(self._slot, -1, -num_tokens)
