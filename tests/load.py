"""A bounded background load for fault tests: a few client threads sending chat completions until stopped; and how
long /health waits beside one hostile request."""
from __future__ import annotations

import threading
import time

import httpx


class BackgroundLoad:
    def __init__(self, url: str, model: str, clients: int = 4, max_tokens: int = 20, stream: bool = True,
                 max_seconds: float = 120.0, headers: dict | None = None):
        self.url = url
        self.body = {
            "model": model, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
        }
        self.stream = stream
        self.headers = headers or {}
        self.deadline = time.monotonic() + max_seconds  # bounded whatever the test does
        self.ok = 0
        self.failures: list[str] = []
        self.slowest = 0.0  # seconds, the longest any request took
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "BackgroundLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60, headers=self.headers) as client:
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                started = time.monotonic()
                outcome = self._one(client)
                with self._lock:
                    self.slowest = max(self.slowest, time.monotonic() - started)
                    if outcome is None:
                        self.ok += 1
                    else:
                        self.failures.append(outcome)

    def _one(self, client: httpx.Client) -> str | None:
        """None when the request fully succeeded, else what went wrong."""
        try:
            if not self.stream:
                r = client.post("/v1/chat/completions", json=self.body)
                return None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
            with client.stream("POST", "/v1/chat/completions", json=self.body) as r:
                if r.status_code != 200:
                    return f"{r.status_code} {r.read()[:200]!r}"
                lines = [line for line in r.iter_lines() if line]
            if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                return f"stream ended badly: {lines[-2:]}"
            return None
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    def wait_for(self, successes: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ok < successes and time.monotonic() < deadline:
            time.sleep(0.05)


def slowest_health_beside(url: str, send, every: float = 0.05) -> float:
    """The longest a GET /health took while `send()` ran in a thread (asked every `every` seconds)."""
    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=60) as http:
        while sender.is_alive():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(every)
    sender.join()
    return slowest
