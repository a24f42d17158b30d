"""When requests are sent: closed loop (at most N in flight, the next as soon as one ends) or open loop
(Poisson arrivals at a mean rate, whatever the server's pace), or both (arrivals at a rate, capped in flight).

An open loop shows what users see when the server falls behind (queues grow, TTFT climbs); a closed loop
measures the most a server does at a set concurrency.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def run_load(send: Callable[[T], Awaitable[R]], items: Sequence[T], max_concurrency: int | None,
                   request_rate: float = math.inf, seed: int = 0,
                   deadline: float | None = None) -> tuple[list[R], float]:
    """Every item sent once (those not started by `deadline`, a time.monotonic() value, are skipped);
    the results in item order, and the seconds from the first send to the last result."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals = random.Random(seed)
    results: list = [None] * len(items)

    async def one(index: int) -> None:
        if limit is None:
            results[index] = await send(items[index])
            return
        async with limit:
            if deadline is None or time.monotonic() < deadline:
                results[index] = await send(items[index])

    started = time.perf_counter()
    tasks = []
    for index in range(len(items)):
        if deadline is not None and time.monotonic() >= deadline:
            break
        tasks.append(asyncio.ensure_future(one(index)))
        if math.isfinite(request_rate) and index < len(items) - 1:
            await asyncio.sleep(arrivals.expovariate(request_rate))
    await asyncio.gather(*tasks)
    return [r for r in results if r is not None], time.perf_counter() - started
