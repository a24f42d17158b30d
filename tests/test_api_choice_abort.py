"""With n > 1, a choice that a stop string ends stops in the engine at once, while its siblings go on
(issue 11.5). Stop strings are matched in the API server, so it must tell the engine; the engine's `stats`
(the development route /server_info) show the sequence gone. The real model, because the simulated engine's
choices are all alike and would all stop together."""
import re
import time

import httpx
import orjson
import pytest

from tests.supervise_process import Supervise

QUESTION = [{"role": "user", "content": "Write a short story about a cat and a dog."}]


@pytest.fixture(scope="module")
def dev():
    # No prefix cache: the second request must sample exactly as the first did (same numbers, same tokens).
    with Supervise("--no-enable-prefix-caching", env={"SUPERVISE_DEV_MODE": "1"}) as server:
        yield server


def running_sequences(group) -> int:
    return httpx.get(f"{group.url}/server_info", timeout=10).json()["engines"][0]["num_running"]


def stop_string_for_choice_0(texts: list[str]) -> str | None:
    """A word early in choice 0's text that choice 1's text never holds."""
    for word in re.findall(r"[A-Za-z]{4,}", texts[0])[:6]:
        if word not in texts[1]:
            return word
    return None


def test_a_choice_ended_by_a_stop_string_stops_in_the_engine(dev):
    model = httpx.get(f"{dev.base_url}/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": QUESTION, "n": 2, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    for seed in range(1, 6):
        texts = [c["message"]["content"] for c in
                 httpx.post(f"{dev.base_url}/chat/completions", json={**body, "seed": seed}, timeout=120).json()["choices"]]
        stop = stop_string_for_choice_0(texts)
        if stop is not None:
            break
    else:
        pytest.fail(f"no seed gave two different texts: {texts}")
    # The same request again, with that stop string and room for choice 1 to run on for many seconds.
    streamed = {**body, "seed": seed, "stop": [stop], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{dev.base_url}/chat/completions", json=streamed, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                choice = orjson.loads(line[6:])["choices"][0]
                if choice["index"] == 0 and choice["finish_reason"] == "stop":
                    break
        else:
            pytest.fail("choice 0 never met its stop string")
        # Choice 1 still runs; choice 0's sequence must be gone from the engine within a few steps.
        deadline = time.monotonic() + 2
        while running_sequences(dev) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running_sequences(dev) == 1
