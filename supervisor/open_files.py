"""The open-files limit the whole group inherits, raised at start-up as far as the hard limit allows.

An API server holds one file descriptor per client connection, so its soft RLIMIT_NOFILE is how many connections
it can hold: past it accept() fails (apiserver/accept_loop.py pauses accepting). Shells and many container
runtimes leave the soft limit at 1024 while the hard one is far higher; a process may raise its own soft limit
up to the hard one, and children inherit it. So the supervisor raises it before it starts anything, as vLLM
does at start-up and as deploy/supervise.service's LimitNOFILE does for systemd.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger("supervisor")

TARGET = 65536  # deploy/supervise.service's LimitNOFILE
TOO_FEW = 4096  # a limit below this is worth a warning: a load test opens more connections than that


def raise_open_files_limit(target: int = TARGET) -> int:
    """Raise the soft limit to `target`, or to the hard limit when that is lower; never lower it. Returns the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # a sandbox that refuses it: serve with what there is
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, wanted, exc)
        else:
            log.info("open-files limit raised from %d to %d (one per client connection in an API server)",
                     soft, wanted)
            soft = wanted
    if soft != resource.RLIM_INFINITY and soft < TOO_FEW:
        log.warning("open-files limit %d (hard limit %s): each API server holds fewer than %d connections; raise "
                    "it with `ulimit -Hn` or systemd's LimitNOFILE", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, soft)
    return soft
