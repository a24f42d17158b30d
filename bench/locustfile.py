"""Locust users for any OpenAI-compatible server: streamed chat completions, with TTFT as a metric of its own.

    .venv/bin/locust -f bench/locustfile.py --headless -u 8 -r 8 -t 20s --host http://127.0.0.1:8000

Locust's table gets two rows per run: `POST chat stream` (the whole stream: its response time is the last
token's, its size the number of output tokens, from the stream's usage chunk: under load one event carries several
tokens, so counting events undercounted them by 5-8% on sim:5) and `TTFT first token` (time to the first text).
Settings, from the environment:
    MODEL        model name (default: the first one the server lists at /v1/models)
    MAX_TOKENS   output tokens per request (default 64)
    PROMPT_WORDS words in each random prompt (default 32)
    IGNORE_EOS   1 (default): always MAX_TOKENS tokens; 0: let the model stop
    API_KEY      sent as a bearer token when set
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, constant, events, task

MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "64"))
PROMPT_WORDS = int(os.environ.get("PROMPT_WORDS", "32"))
IGNORE_EOS = os.environ.get("IGNORE_EOS", "1") != "0"
API_KEY = os.environ.get("API_KEY")
WORDS = ("time year people way day thing world life hand part child eye woman place work week case point "
         "number group problem fact city river music light story question garden window market").split()


class StreamingChatUser(HttpUser):
    wait_time = constant(0)
    model: str | None = os.environ.get("MODEL")

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"
        if StreamingChatUser.model is None:
            listed = self.client.get("/v1/models", name="GET /v1/models").json()
            StreamingChatUser.model = listed["data"][0]["id"]

    @task
    def stream_chat(self) -> None:
        prompt = " ".join(random.choice(WORDS) for _ in range(PROMPT_WORDS))
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": IGNORE_EOS}
        started = time.perf_counter()
        first_token_at = None
        tokens = None  # the usage chunk's count
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat stream") as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    response.failure(f"error event: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        if first_token_at is None:
                            first_token_at = time.perf_counter()
                            self._fire_ttft(first_token_at - started)
            # Locust timed the response headers; the figure users feel is the whole stream.
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            response.request_meta["response_length"] = tokens or 0
            if first_token_at is None:
                response.failure("the stream carried no text")
            elif tokens is None:
                response.failure("the stream ended without its usage chunk")
            else:
                response.success()

    def _fire_ttft(self, seconds: float) -> None:
        events.request.fire(request_type="TTFT", name="first token", response_time=seconds * 1000,
                            response_length=0, exception=None, context={})
