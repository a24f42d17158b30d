"""--api-key: the keys a client may send as `Authorization: Bearer <key>` (HTTP) or `authorization` metadata (gRPC).

Several may be given (the option repeated, or SUPERVISE_API_KEY holding them separated by spaces, as vLLM takes a
list), so that a key can be rotated: the group starts with the old and the new, clients move to the new, the group
restarts with it alone. Each is compared as a SHA-256 digest with hmac.compare_digest: constant time, whatever the
lengths, and every key is compared, so the time does not tell which one nearly matched.
"""
from __future__ import annotations

import hashlib
import hmac
import os

from ipc.config import ServeConfig


def api_keys_of(config: ServeConfig) -> tuple[str, ...]:
    """The keys this group takes; none: no key is asked for."""
    return config.api_key or tuple(os.environ.get("SUPERVISE_API_KEY", "").split())


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def match(self, token: bytes) -> bool:
        digest = hashlib.sha256(token).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return matched
