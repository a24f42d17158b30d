"""Each API server pings its engines every few seconds, and stops itself when one is gone for good.

The supervisor notices a local engine's death first (its sentinel) and marks it in shared memory; this check
is for what the supervisor cannot see: an engine on another node, or one that stopped answering without
exiting. A single slow answer (a long prefill step) is not a death: only several missed pings in a row are.
"""
from __future__ import annotations

import asyncio
import logging

from apiserver.engine_client import EngineClient, EngineDeadError

log = logging.getLogger(__name__)

PING_EVERY = 5.0
MISSED_PINGS_FOR_GONE = 3


async def watch_engines(engine: EngineClient, on_gone) -> None:
    """Calls on_gone(reason) once an engine missed MISSED_PINGS_FOR_GONE pings in a row, then returns."""
    missed = [0] * engine.num_engines
    while True:
        await asyncio.sleep(PING_EVERY)
        for rank in range(engine.num_engines):
            try:
                await engine.call_utility(rank, "ping", timeout=PING_EVERY)
                missed[rank] = 0
            except EngineDeadError:
                return  # already known dead (ENGINE_DEAD or the supervisor's mark): the supervisor acts
            except asyncio.TimeoutError:
                missed[rank] += 1
                log.warning("engine core DP%d missed %d ping(s) in a row", rank, missed[rank])
                if missed[rank] >= MISSED_PINGS_FOR_GONE:
                    reason = f"engine core DP{rank} has not answered for {missed[rank] * PING_EVERY * 2:.0f} s"
                    engine.mark_dead(reason)
                    on_gone(reason)
                    return
