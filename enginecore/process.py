"""Entry point of an engine core process (the supervisor starts it with multiprocessing `spawn`).

CONTRACT (the supervisor relies on exactly this):
    run_engine_core(config: ServeConfig, rank: int, ready: Connection, lifeline: Connection) -> None
- set the process title `supervise: EngineCore_DP<rank>`, call ipc.logs.setup_logging(f"EngineCore_DP{rank}",
  config.log_level) and ipc.lifeline.die_with_parent(lifeline);
- resolve and load the model (enginecore.model_source), log progress, allocate the KV cache;
- bind the ROUTER at ipc.sockets.engine_address(config.runtime_dir, rank);
- then send exactly one record over `ready`: ipc.model_info.EngineReady, or EngineFailed(user_error=True) for a
  bad --model (the supervisor prints the one line and exits 2), or EngineFailed(user_error=False) otherwise;
- serve until SIGTERM/SIGINT (exit code 0). If the loop raises: send ENGINE_DEAD to every API server it has heard
  from, log the traceback, exit code 1.
"""
