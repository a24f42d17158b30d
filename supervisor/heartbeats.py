"""Which API servers' event loops have fallen silent: the one rule the watchdog (while the group serves) and the
group's stop (while its servers drain) both apply. A server beats every second from its event loop
(apiserver/server.py); one silent past --heartbeat-timeout is SIGSTOPped, wedged in a C call, or looping."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from supervisor.children import Child


def silent_servers(children: Iterable[Child], silent_for: Callable[[int, float], float], now: float,
                   timeout: float) -> list[tuple[Child, float]]:
    """(server, seconds silent) of each ready, live API server among `children` silent for more than `timeout`
    and not being killed already; `silent_for(index, now)`: seconds since that server's last beat."""
    found = []
    for child in children:
        if child.kind != "api" or not child.ready or not child.alive or child.kill_reason is not None:
            continue
        silent = silent_for(child.index, now)
        if silent > timeout:
            found.append((child, silent))
    return found
