"""Entry point of an API server process (the supervisor starts it with multiprocessing `spawn`).

CONTRACT (the supervisor relies on exactly this):
    run_api_server(launch: ipc.launch.ApiServerLaunch) -> None
  (config, index, listen_socket, model, engine_addresses, shared_state, ready, lifeline: see ApiServerLaunch)
- set the process title `supervise: ApiServer_<index>`, ipc.logs.setup_logging(f"ApiServer_{index}", ...),
  ipc.lifeline.die_with_parent(lifeline); ipc.shared_state.GroupState.attach(shared_state), claim(index);
- load the tokenizer from model.model_dir without importing torch or transformers;
- connect a DEALER (identity api-<index>) to every engine address (CURVE with launch.curve on TCP) and ping
  each that the supervisor has not marked down (UTILITY "ping");
- send True over `ready` once it can serve, then accept on the already-listening `listen_socket`;
- event loop beats GroupState.beat(index) every second;
- SIGTERM/SIGINT: stop accepting, let in-flight requests finish up to config.shutdown_timeout, exit code 0.
"""
from __future__ import annotations

import asyncio
import logging
import os

from apiserver.engine_errors import EngineDeadError
from ipc.heap import freeze_start_up
from ipc.launch import ApiServerLaunch
from ipc.lifeline import die_with_parent
from ipc.logs import setup_logging
from ipc.shared_state import GroupState
from ipc.tls import BadTls

log = logging.getLogger("apiserver")

ENGINE_PING_TIMEOUT = 60.0
ENGINE_GONE_EXIT_CODE = 3  # the engine stopped answering: the supervisor logs this exit and decides


def enter_process(launch: ApiServerLaunch):
    """The first steps of an API server process, HTTP or gRPC alike: its title and log name, death with the
    supervisor, stop signals caught from here on, its shared-memory slot claimed. Returns (StopSignals, group)."""
    from setproctitle import setproctitle

    from apiserver.server import StopSignals

    setproctitle(f"supervise: ApiServer_{launch.index}")
    setup_logging(f"ApiServer_{launch.index}", launch.config.log_level)
    die_with_parent(launch.lifeline, runtime_dir=launch.config.runtime_dir)
    stop = StopSignals()
    group = GroupState.attach(launch.shared_state)
    group.claim(launch.index, os.getpid())
    return stop, group


async def reach_engines(engine) -> None:
    """Ping every engine not down before serving; one that does not answer in time stops this server with one
    line (the supervisor, which pings its engines too, decides about the engine)."""
    try:
        await engine.start(ENGINE_PING_TIMEOUT)
    except TimeoutError:
        log.error("stopping: an engine core did not answer the first ping within %.0f s", ENGINE_PING_TIMEOUT)
        raise SystemExit(ENGINE_GONE_EXIT_CODE) from None
    except EngineDeadError as exc:  # it died meanwhile (the supervisor killed a frozen one, say)
        log.error("stopping: %s", exc)
        raise SystemExit(ENGINE_GONE_EXIT_CODE) from None


def run_api_server(launch: ApiServerLaunch) -> None:
    config, model = launch.config, launch.model
    stop, group = enter_process(launch)

    import uvloop

    from apiserver.byte_stream import byte_tables
    from apiserver.renderer import Renderer, load_tokenizer

    renderer = Renderer(load_tokenizer(model.model_dir), config.chat_template, config.tokenizer_word_cache)
    log.info("tokenizing: %s", renderer.tokenizing)
    # Made here, not at the first stream: checking the table decodes every token of the vocabulary, twice.
    tables = byte_tables(renderer.tokenizer)
    log.info("detokenizing: %s", "each token's bytes from a table (byte-level BPE)" if tables is not None
             else "tokenizers' DecodeStream")
    _return_freed_heap()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(launch, group, renderer, stop))
    except BadTls as exc:  # the checked copy (ipc.tls.kept_files) no longer reads: the runtime directory changed
        log.error("cannot serve TLS: %s", exc)
        raise SystemExit(1) from None
    group.close()
    log.info("stopped")


def _return_freed_heap() -> None:
    """Parsing tokenizer.json frees as much heap again as the tokenizer keeps (about 45 MB for a 128k vocabulary),
    which glibc holds on to: hand it back, so the RSS is what the server uses."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


async def _serve(launch: ApiServerLaunch, group, renderer, stop) -> None:
    from apiserver.admission import AdmissionControl
    from apiserver.app import build_app
    from apiserver.context import ServerContext
    from apiserver.engine_client import EngineClient
    from apiserver.engine_watch import watch_engines
    from apiserver.metrics import Metrics
    from apiserver.server import beat_forever, build_http_server

    config, index, listen_socket, model, ready = (
        launch.config, launch.index, launch.listen_socket, launch.model, launch.ready
    )
    engine = EngineClient.for_launch(launch, group)
    ctx = ServerContext(
        config=config,
        index=index,
        model=model,
        renderer=renderer,
        engine=engine,
        group=group,
        admission=AdmissionControl(group, index, config.max_num_queued_reqs, config.max_num_queued_tokens),
        metrics=Metrics(config.runtime_dir, index, config.metrics_names),
    )
    heartbeat = asyncio.create_task(beat_forever(group, index, ctx.engine_dead_reason), name="heartbeat")
    try:
        ctx.sync_down_ranks()  # a rank already down is neither pinged nor sent work
        await reach_engines(engine)
        server = build_http_server(build_app(ctx), config, group, index, ctx.metrics, engine.fail_in_flight)
        freeze_start_up()
        ready.send(True)
        if stop.received:
            return
        gone: list[str] = []

        def on_engine_gone(reason: str) -> None:
            log.error("stopping: %s", reason)
            gone.append(reason)
            server.should_exit = True

        watcher = asyncio.create_task(
            watch_engines(engine, config.engine_ping_interval, on_engine_gone, ctx.sync_down_ranks),
            name="engine-watch",
        )
        await server.serve(sockets=[listen_socket])
        watcher.cancel()
        if gone:
            raise SystemExit(ENGINE_GONE_EXIT_CODE)
    finally:
        heartbeat.cancel()
        await ctx.grammars.close()
        await engine.close()
