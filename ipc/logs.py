"""One log format for every process of the group: each line names the process that wrote it."""
from __future__ import annotations

import logging
import sys

from ipc.log_throttle import LineThrottle

FORMAT = "%(asctime)s %(levelname)-7s [{process}] %(name)s: %(message)s"


def setup_logging(process_name: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT.format(process=process_name), datefmt="%H:%M:%S"))
    handler.addFilter(LineThrottle())  # a flood of bad requests must not become a flood of lines
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Access logs of every request would drown the rest at info level.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
