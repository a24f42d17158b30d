"""One OpenAI-compatible generation request, timed: when each piece of text arrived, how many tokens came.

Works with any server that speaks the OpenAI API (ours, vLLM, ...): `stream_options.include_usage` asks for the
token counts in a last chunk; a server that sends none is counted one token per content event. `ignore_eos`
(a vLLM extension ours shares) makes every request produce exactly `max_tokens`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

try:
    import orjson

    _loads, _dumps = orjson.loads, orjson.dumps
except ImportError:  # orjson is a project dependency, but this file must also run beside another server
    import json

    _loads, _dumps = json.loads, lambda obj: json.dumps(obj).encode()

from http_client import HttpClient


@dataclass
class RequestRecord:
    """What one request did. Times in seconds of time.perf_counter()."""

    start: float
    end: float = 0.0
    status: int | str = 0  # the HTTP status, or the exception's name when there was no response
    error: str = ""
    token_times: list[float] = field(default_factory=list)  # arrival of each content event
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.output_tokens < 2 or not self.token_times:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def request_body(model: str, prompt: str, max_tokens: int, chat: bool, stream: bool, ignore_eos: bool) -> bytes:
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return _dumps(body)


class _SseTimer:
    """Splits a streamed body into SSE events and notes when each event with text arrived."""

    def __init__(self, record: RequestRecord, chat: bool):
        self.record = record
        self.chat = chat
        self.buffer = b""
        self.content_events = 0
        self.usage: dict | None = None

    def feed(self, piece: bytes) -> None:
        now = time.perf_counter()
        data = self.buffer + piece
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self.buffer = data.split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments (": keep-alive"), event names, ids
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            try:
                chunk = _loads(payload)
            except ValueError:
                self.record.error = f"unparsable event: {payload[:100]!r}"
                return
            if "error" in chunk:
                self.record.error = f"error event: {str(chunk['error'])[:200]}"
                return
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                if text:
                    self.record.token_times.append(now)
                    self.content_events += 1
                    break


async def send(client: HttpClient, body: bytes, chat: bool, stream: bool, timeout: float | None) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    path = "/chat/completions" if chat else "/completions"
    pieces: list[bytes] = []
    timer = _SseTimer(record, chat) if stream else None
    try:
        status = await client.post(path, body, sink=pieces.append if timer is None else timer.feed, timeout=timeout)
    except (asyncio.TimeoutError, OSError, ValueError) as exc:
        record.end = time.perf_counter()
        record.status, record.error = type(exc).__name__, str(exc)[:200] or type(exc).__name__
        return record
    record.end = time.perf_counter()
    record.status = status
    if status != 200:
        body_text = (b"".join(pieces) if timer is None else timer.buffer)[:300]
        record.error = body_text.decode(errors="replace") or f"HTTP {status}"
        return record
    usage = timer.usage if timer is not None else _non_streamed(record, b"".join(pieces), chat)
    if usage:
        record.output_tokens = usage.get("completion_tokens") or 0
        record.prompt_tokens = usage.get("prompt_tokens") or 0
    elif timer is not None:
        record.output_tokens = timer.content_events
    return record


def _non_streamed(record: RequestRecord, payload: bytes, chat: bool) -> dict | None:
    try:
        response = _loads(payload)
    except ValueError:
        record.error = f"unparsable body: {payload[:100]!r}"
        return None
    choices = response.get("choices") or [{}]
    text = (choices[0].get("message") or {}).get("content") if chat else choices[0].get("text")
    if text:
        record.token_times.append(record.end)  # without a stream, the first token is seen with the last
    return response.get("usage")
