"""Each API server pings its engines at a steady pace: /health says 503 from the first missed ping until one
is answered again, and the server stops itself when an engine is gone for good.

The supervisor notices a local engine's death first (its sentinel), and a remote rank's loss (its node's
supervisor says so, or falls silent: supervisor/registration.py), and marks it in shared memory; the pings are
for an engine that stopped answering without exiting (SIGSTOP, a wedged step). The supervisor that started it
pings it too and kills it then (supervisor/engine_liveness.py), so that it is handled as any engine's death.
An engine answers pings from its I/O thread while a step runs (enginecore/engine_io.py), so a long step is no miss;
one past --engine-step-timeout is, on purpose. A ping is missed when it is not answered within the interval
(--engine-ping-interval). One miss already turns /health to 503, so a load balancer stops sending here
while requests would hang; the server exits only after MISSED_PINGS_FOR_GONE misses in a row, since a single
slow answer (a busy machine) is not a death; and only when no other rank answers: while one does, a rank silent
that long has its requests failed and gets no work, and the server serves on with the others.
"""
from __future__ import annotations

import asyncio
import logging
import time

from apiserver.engine_client import EngineClient
from apiserver.engine_errors import EngineDeadError
from ipc.config import MISSED_PINGS_FOR_GONE

log = logging.getLogger(__name__)


async def watch_engines(engine: EngineClient, interval: float, on_gone, sync=None) -> None:
    """Probes every engine not down each `interval` seconds (UTILITY stats: the answer also refreshes the
    engine's load for balancing); calls on_gone(reason) once one missed MISSED_PINGS_FOR_GONE probes in a row
    while no other answers, then returns. Returns too once every engine is down (the supervisor acts on that).
    `sync()`, before each round, takes the ranks the supervisor marked down: a rank whose node is gone is not
    missed, it is down."""
    missed = [0] * engine.num_engines
    last_answer = [time.monotonic()] * engine.num_engines
    while True:
        if sync is not None:
            sync()
        if not engine.usable():
            return
        started = time.monotonic()
        probed = engine.usable()
        answers = await asyncio.gather(
            *(engine.call_utility(i, "stats", timeout=interval) for i in probed), return_exceptions=True,
        )
        for i, answer in zip(probed, answers):
            rank = engine.ranks[i]
            if isinstance(answer, EngineDeadError):
                continue  # down meanwhile (ENGINE_DEAD or the supervisor's mark): the supervisor acts
            if not isinstance(answer, asyncio.TimeoutError):
                if missed[i]:
                    log.info("engine core DP%d answers pings again", rank)
                missed[i] = 0
                last_answer[i] = time.monotonic()
                engine.set_unanswered(i, None)
                if isinstance(answer, dict):
                    engine.loads.report(i, answer.get("num_running", 0), answer.get("num_waiting", 0),
                                        answer.get("kv_cache_usage", 0.0))
                continue
            missed[i] += 1
            silent = time.monotonic() - last_answer[i]
            reason = f"engine core DP{rank} has not answered a ping for {silent:.1f} s"
            log.warning("engine core DP%d missed %d ping(s) in a row", rank, missed[i])
            engine.set_unanswered(i, reason)
            if missed[i] < MISSED_PINGS_FOR_GONE:
                continue
            if any(engine.answering(j) for j in engine.usable() if j != i):
                # Other ranks answer: they serve on. This one's requests fail (their engine is wedged, or cut
                # off), it gets no new work while silent, and it is taken back if it answers again; its
                # supervisor kills a wedged one soon (then it is down). Exiting here had stopped every API server
                # at once, the live ranks' requests with them, until replacements that waited on this one.
                if missed[i] == MISSED_PINGS_FOR_GONE:
                    log.error("%s: its requests fail; the other ranks serve on", reason)
                    engine.fail_requests_on(i, reason)
                continue
            engine.mark_down(i, reason)
            on_gone(reason)
            return
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
