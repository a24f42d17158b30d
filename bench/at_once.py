"""Many clients at the same moment, with a watcher beside them: the threads of the hostile-load benchmarks."""
from __future__ import annotations

import threading
import time
from typing import Callable


def at_once(send: Callable[[], None], count: int, watch: Callable[[threading.Event], None],
            lead_s: float = 0.0) -> float:
    """`watch(done)` in a thread of its own (`lead_s` seconds ahead), then `send` in `count` threads started
    together; once they end, `done` is set and the watcher joined. The seconds the senders took."""
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(done,))
    watcher.start()
    time.sleep(lead_s)
    senders = [threading.Thread(target=send) for _ in range(count)]
    started = time.monotonic()
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    took = time.monotonic() - started
    done.set()
    watcher.join()
    return took
