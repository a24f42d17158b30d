"""--max-large-request-bodies-mb: the bytes of large request bodies (LARGE_BODY_BYTES and up) one API server holds
at once. An HTTP body counts as its bytes are read (apiserver/middleware.py), a gRPC message when it arrives whole
(apiserver/grpc/messages.py); either counts until its request ends. What they become weighs several times their
bytes while they are parsed and run (a chat of many messages some 27 times, a gRPC prompt of millions of ids 4-5
times), so many at once could take an API server out of memory: one that would pass the limit is refused, to be
retried (HTTP 503, gRPC RESOURCE_EXHAUSTED). One alone always passes; small bodies never count."""
from __future__ import annotations


class LargeBodyBudget:
    def __init__(self, limit_mb: int):
        self.limit = limit_mb * 2**20  # 0: none
        self.held = 0

    def refusal(self, size: int, own: int = 0) -> str | None:
        """Why `size` more bytes, for a body that holds `own` already, may not be taken now; None when they may."""
        held = self.held
        if self.limit and held > own and held + size > self.limit:
            return (f"This server holds {held / 2**20:.0f} MB of large request bodies already, with its limit at "
                    f"{self.limit // 2**20} MB (--max-large-request-bodies-mb); retry later.")
        return None

    def take(self, size: int) -> None:
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size
