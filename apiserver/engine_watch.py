"""Each API server pings its engines at a steady pace: /health says 503 from the first missed ping until one
is answered again, and the server stops itself when an engine is gone for good.

The supervisor notices a local engine's death first (its sentinel) and marks it in shared memory; the pings
are for what the supervisor cannot see: an engine on another node, or one that stopped answering without
exiting (SIGSTOP, a wedged step). A ping is missed when it is not answered within the interval
(--engine-ping-interval). One miss already turns /health to 503, so a load balancer stops sending here
while requests would hang; the server exits only after MISSED_PINGS_FOR_GONE misses in a row, since a single
slow answer (a long prefill step) is not a death.
"""
from __future__ import annotations

import asyncio
import logging
import time

from apiserver.engine_client import EngineClient, EngineDeadError

log = logging.getLogger(__name__)

MISSED_PINGS_FOR_GONE = 3


async def watch_engines(engine: EngineClient, interval: float, on_gone) -> None:
    """Pings every engine each `interval` seconds; calls on_gone(reason) once one missed
    MISSED_PINGS_FOR_GONE pings in a row, then returns."""
    missed = [0] * engine.num_engines
    last_answer = [time.monotonic()] * engine.num_engines
    while True:
        started = time.monotonic()
        answers = await asyncio.gather(
            *(engine.call_utility(rank, "ping", timeout=interval) for rank in range(engine.num_engines)),
            return_exceptions=True,
        )
        for rank, answer in enumerate(answers):
            if isinstance(answer, EngineDeadError):
                return  # already known dead (ENGINE_DEAD or the supervisor's mark): the supervisor acts
            if not isinstance(answer, asyncio.TimeoutError):
                if missed[rank]:
                    log.info("engine core DP%d answers pings again", rank)
                missed[rank] = 0
                last_answer[rank] = time.monotonic()
                engine.set_unanswered(rank, None)
                continue
            missed[rank] += 1
            silent = time.monotonic() - last_answer[rank]
            reason = f"engine core DP{rank} has not answered a ping for {silent:.1f} s"
            log.warning("engine core DP%d missed %d ping(s) in a row", rank, missed[rank])
            engine.set_unanswered(rank, reason)
            if missed[rank] >= MISSED_PINGS_FOR_GONE:
                engine.mark_dead(reason)
                on_gone(reason)
                return
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
