"""The first code every child runs: detach from the terminal's signals, then call the real entry point.

A child in its own process group gets no Ctrl+C from the terminal: only the supervisor decides when and in
which order children stop (API servers drain first, engines last). The entry point is named by a dotted
path so the supervisor never imports enginecore (torch) itself; it gets one argument, its ipc.launch record.
"""
from __future__ import annotations

import importlib
import os


def run_child(entry: str, launch) -> None:
    os.setpgrp()
    module_name, function_name = entry.rsplit(":", 1)
    getattr(importlib.import_module(module_name), function_name)(launch)
