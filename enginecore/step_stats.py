"""The engine's activity in the log: one line every --log-stats-interval seconds while it works (vLLM logs the
same kind of line), e.g.

    engine: 412 steps in 10.0 s (31 with prompt tokens; 380 replayed from CUDA graphs), 24.3 ms a step; 5,210 prompt and
    10,400 generated tokens/s; 64 running, 0 waiting, KV cache 12%

An operator sees the engine's pace and load without a metrics stack; a benchmark run on a GPU sees how many steps
held prompt tokens, how many ran eagerly (long prefills, or all with --enforce-eager) and what a step costs. The engine counts (StepCounts,
updated by the engine as it steps); the serve loop times the steps and writes the line.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class StepCounts:
    """Running totals an engine keeps; the logger reads their change over each interval."""

    steps: int = 0
    graph_steps: int = 0  # steps replayed from a CUDA graph
    prompt_steps: int = 0  # steps with a prompt chunk of more than one token
    prompt_tokens: int = 0  # prompt tokens computed (prefill chunks, recomputes after preemption)
    generated_tokens: int = 0


class StepStatsLog:
    def __init__(self, counts: StepCounts, interval: float, load=None, clock=time.monotonic):
        """load: a callable returning the engine's EngineLoad, for the line's tail (None: no tail)."""
        self.counts = counts
        self.interval = interval
        self._load = load
        self._clock = clock
        self._since = clock()
        self._busy = 0.0  # seconds spent in steps since the last line
        self._last = StepCounts()
        self._window_open = False  # the next step starts the window (an idle engine writes nothing)

    def stepped(self, seconds: float) -> None:
        """One engine step took `seconds`; writes the line when the interval is over."""
        now = self._clock()
        if not self._window_open:
            self._since, self._window_open = now - seconds, True
        self._busy += seconds
        self.write_if_due(now)

    def due_in(self) -> float | None:
        """Seconds until the line is due (an idle loop waits no longer than that); None: nothing to write."""
        return max(0.0, self._since + self.interval - self._clock()) if self._window_open else None

    def write_if_due(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        if self._window_open and now - self._since >= self.interval:
            self.write(now)

    def write(self, now: float) -> None:
        c, last = self.counts, self._last
        steps = c.steps - last.steps
        elapsed = now - self._since
        if steps and elapsed > 0:
            line = (f"engine: {steps} steps in {elapsed:.1f} s ({c.prompt_steps - last.prompt_steps} with prompt "
                    f"tokens; {c.graph_steps - last.graph_steps} replayed from CUDA graphs), "
                    f"{self._busy / steps * 1e3:.1f} ms a step; "
                    f"{(c.prompt_tokens - last.prompt_tokens) / elapsed:,.0f} prompt and "
                    f"{(c.generated_tokens - last.generated_tokens) / elapsed:,.0f} generated tokens/s")
            if self._load is not None:
                load = self._load()
                line += f"; {load.num_running} running, {load.num_waiting} waiting, KV cache {load.kv_cache_usage:.0%}"
            log.info(line)
        self._since, self._busy, self._window_open = now, 0.0, False
        self._last = dataclasses.replace(c)
