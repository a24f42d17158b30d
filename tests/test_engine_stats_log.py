"""The engine's line of activity in the log (--log-stats-interval): the real group writes it while it works and
not when told 0; the line's figures from scripted counts and clock."""
import logging
import re
import time

import httpx

from enginecore.engine_base import EngineLoad
from enginecore.step_stats import StepCounts, StepStatsLog

LINE = re.compile(r"engine: (\d+) steps in ([\d.]+) s \((\d+) with prompt tokens; (\d+) replayed from CUDA graphs\), "
                  r"([\d.]+) ms a step; ([\d,]+) prompt and ([\d,]+) generated tokens/s; (\d+) running, "
                  r"(\d+) waiting, KV cache (\d+)%")


def test_the_line_from_scripted_counts(caplog):
    now = [100.0]
    counts = StepCounts()
    log = StepStatsLog(counts, 10.0, lambda: EngineLoad(3, 1, 0.25), clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="enginecore.step_stats")
    now[0] += 50.0  # idle since start: not part of the first line
    for _ in range(40):  # 40 steps of 0.25 s back to back: the line comes once 10 s have passed, not before
        counts.steps += 1
        counts.graph_steps += 1
        counts.prompt_steps += counts.steps % 2
        counts.generated_tokens += 3
        now[0] += 0.25
        log.stepped(0.25)
        assert not caplog.records or counts.steps == 40
    (line,) = [r.getMessage() for r in caplog.records]
    steps, seconds, prompt_steps, graphs, ms, prompt, generated, running, waiting, kv = LINE.fullmatch(line).groups()
    assert (steps, prompt_steps, graphs, seconds, ms) == ("40", "20", "40", "10.0", "250.0")  # from the first step's start
    assert (prompt, generated, running, waiting, kv) == ("0", "12", "3", "1", "25")
    caplog.clear()
    now[0] += 20.0  # idle for a while: no steps, no line
    log.write(now[0])
    assert not caplog.records


def _stream(server, tokens: int) -> int:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    body["model"] = httpx.get(f"{server.base_url}/models").json()["data"][0]["id"]
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as reply:
        return sum(1 for line in reply.iter_lines() if line.startswith("data: {"))


def test_the_group_logs_its_engine_activity_and_can_be_told_not_to(start_supervise):
    server = start_supervise("--model", "sim:5", "--log-stats-interval", "0.5")
    assert _stream(server, 200) > 100  # a second of steps (an SSE event may carry several tokens)
    _stream(server, 20)  # 0.1 s: its line comes when the interval is over, the engine idle by then
    time.sleep(1.0)
    lines = [LINE.search(line) for line in server.log().splitlines() if "engine: " in line]
    assert lines and all(lines), server.log()[-2000:]
    steps, _, prompt_steps, graphs, _, _, generated, *_ = lines[0].groups()
    assert int(steps) > 10 and int(prompt_steps) <= 1 and graphs == "0" and int(generated.replace(",", "")) > 0
    assert sum(int(m.group(1)) for m in lines) >= 220  # every step of both streams is in some line
    quiet = start_supervise("--model", "sim:5", "--log-stats-interval", "0")
    assert _stream(quiet, 200) > 100
    assert "engine: " not in quiet.log()
