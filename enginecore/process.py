"""Entry point of an engine core process (the supervisor starts it with multiprocessing `spawn`).

CONTRACT (the supervisor relies on exactly this):
    run_engine_core(launch: ipc.launch.EngineLaunch) -> None   (config, rank, ready, lifeline: see EngineLaunch)
- set the process title `supervise: EngineCore_DP<rank>`, call ipc.logs.setup_logging(f"EngineCore_DP{rank}",
  config.log_level) and ipc.lifeline.die_with_parent(lifeline);
- build the engine: for `--model sim:<ms>` the simulated engine (enginecore.simulated, a benchmark instrument
  that never imports torch), else resolve and load the model (enginecore.model_source), log progress, allocate
  the KV cache; both then run the same loop (enginecore.serve_loop);
- bind the ROUTER at launch.endpoint (ipc:// beside the API servers, tcp:// on a headless node, CURVE with
  launch.curve there);
- then send exactly one record over `ready`: ipc.model_info.EngineReady (with the address bound), or EngineFailed(user_error=True) for a
  bad --model (the supervisor prints the one line and exits 2), or EngineFailed(user_error=False) otherwise;
- serve until SIGTERM/SIGINT (exit code 0). If the loop raises: send ENGINE_DEAD to every API server it has heard
  from (the serve loop's I/O thread does, and flushes it), log the traceback, exit code 1.
"""
from __future__ import annotations

import logging
import signal
import sys
import traceback

from ipc.config import ServeConfig
from ipc.heap import freeze_start_up
from ipc.launch import EngineLaunch
from ipc.lifeline import die_with_parent
from ipc.logs import setup_logging
from ipc.model_info import EngineFailed, EngineReady
from ipc.sockets import bind_router, bound_address

log = logging.getLogger("enginecore")


class ShutdownRequested(BaseException):
    """SIGTERM or SIGINT: stop now, cleanly (a BaseException so no `except Exception` swallows it)."""


def _on_signal(signum, frame):
    # Once: the stop is under way, and a second signal raised in its cleanup came out as a traceback. A dying
    # supervisor sends two (the parent-death signal and the lifeline's); one that hangs is SIGKILLed.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise ShutdownRequested(signal.Signals(signum).name)


def run_engine_core(launch: EngineLaunch) -> None:
    config, rank, lifeline = launch.config, launch.rank, launch.lifeline
    try:
        from setproctitle import setproctitle

        setproctitle(f"supervise: EngineCore_DP{rank}")
    except ImportError:
        pass
    setup_logging(f"EngineCore_DP{rank}", config.log_level)
    # Before the model loads, so a stop asked for during a long load is prompt too.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    die_with_parent(lifeline, runtime_dir=config.runtime_dir)
    try:
        _serve(launch)
    except ShutdownRequested as stop:
        log.info("stopping (%s)", stop)
        sys.exit(0)


def _serve(launch: EngineLaunch) -> None:
    import zmq

    from enginecore.engine_base import BadEngineSetting
    from enginecore.model_source import ModelSourceError
    from enginecore.serve_loop import EngineServer

    config, rank, ready = launch.config, launch.rank, launch.ready
    try:
        core = _make_engine(config, rank)
        ctx = zmq.Context()
        router = bind_router(ctx, launch.endpoint, launch.curve)
    except (ModelSourceError, BadEngineSetting) as exc:
        ready.send(EngineFailed(rank, str(exc), user_error=True))
        sys.exit(2)
    except Exception as exc:
        log.error("engine start-up failed:\n%s", traceback.format_exc())
        ready.send(EngineFailed(rank, f"{type(exc).__name__}: {exc}", user_error=False))
        sys.exit(1)
    info = core.model_info
    address = bound_address(router)
    freeze_start_up(young_threshold=None)  # torch's and the model's objects: a full collection walked them all
    ready.send(EngineReady(rank, info, address))
    ready.close()
    # Not "serving": that word is the supervisor's line once the whole group serves (tests wait for it).
    log.info("ready: %s on %s, %d KV blocks, asynchronous scheduling %s, listening at %s", config.model_name,
             info.device, info.num_kv_blocks, "on" if getattr(core, "async_scheduling", False) else "off", address)

    server = EngineServer(core, router, config.engine_step_timeout, config.log_stats_interval)  # the router is its I/O thread's from here
    try:
        server.serve_forever()
    except Exception as exc:
        log.error("engine loop failed:\n%s", traceback.format_exc())
        # The I/O thread sends ENGINE_DEAD to every API server and closes the socket with a linger; term() lets it
        # leave (only once the socket is closed: term() would wait for an open one forever).
        if server.close(f"engine core {rank} failed: {type(exc).__name__}: {exc}"):
            ctx.term()
        sys.exit(1)
    finally:
        server.close()  # SIGTERM: stop the I/O thread and close the socket (nothing to flush)


def _make_engine(config: ServeConfig, rank: int):
    """The engine `config.model` names. Imported here, not above: the simulated engine must not load torch."""
    from enginecore import simulated

    if simulated.is_simulated(config.model):
        return simulated.SimulatedEngine(config)
    from enginecore.engine import EngineCore

    return EngineCore(_device_for_rank(config, rank))


def _device_for_rank(config: ServeConfig, rank: int) -> ServeConfig:
    """With data parallelism on CUDA, rank r takes GPU r (unless --device names one)."""
    if config.data_parallel_size > 1 and config.device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return config.replace(device=f"cuda:{rank % torch.cuda.device_count()}")
    return config
