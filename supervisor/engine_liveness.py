"""The supervisor's own pings to the engines it started: an engine that stops answering without exiting (SIGSTOP,
a wedged step, one step past --engine-step-timeout, which silences its pings on purpose) is killed, so that the
group handles it as any engine's death: it goes down (exit 1), or restarts with --on-engine-failure restart.

Without this, only the API servers noticed: each stopped itself (ENGINE_GONE_EXIT_CODE), its replacement waited a
minute for the engine's first answer and died, and the next one did the same, slowly enough never to exhaust
--max-restarts: the group hung, accepting connections it never answered.

The verdict comes after the API servers' (ipc.config.MISSED_PINGS_FOR_GONE intervals without an answer), two
intervals later, counted from the first ping left unanswered: the API servers, pinging on their own schedules,
stop first (their log says so, /health is 503 from the first miss), and an engine that thaws in time is left alone.
"""
from __future__ import annotations

import logging
import time

from ipc.config import MISSED_PINGS_FOR_GONE
from supervisor.children import Child
from supervisor.engine_link import EngineLink

log = logging.getLogger(__name__)


class EngineLiveness:
    def __init__(self, interval: float):
        """`interval`: --engine-ping-interval."""
        self.interval = interval
        self._last_ping = time.monotonic()

    def kill_silent(self, link: EngineLink | None, engines: list[Child]) -> None:
        """Ping `engines` (the local ones) once per interval, and kill those silent for too long: their exits are
        then handled as any engine's death."""
        if link is None:  # (the engines are not serving yet)
            return
        watched = [child for child in engines if child.alive and child.kill_reason is None]
        now = time.monotonic()  # EngineLink's clock
        if now - self._last_ping >= self.interval:
            self._last_ping = now
            for child in watched:
                link.ping(child.index)
        limit = (MISSED_PINGS_FOR_GONE + 2) * self.interval
        for child in watched:
            silent = link.silent_for(child.index, now)
            if silent > limit:
                log.error("%s has answered no ping for %.0f s: killing it", child.name, silent)
                child.kill(f"it answered no ping for {silent:.0f} s (frozen, or one step past --engine-step-timeout)")
