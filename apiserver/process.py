"""Entry point of an API server process (the supervisor starts it with multiprocessing `spawn`).

CONTRACT (the supervisor relies on exactly this):
    run_api_server(config: ServeConfig, index: int, listen_socket: socket.socket, model: ModelInfo,
                   engine_addresses: list[str], shared_state_name: str, group_lock, lifeline: Connection,
                   ready: Connection) -> None
- set the process title `supervise: ApiServer_<index>`, ipc.logs.setup_logging(f"ApiServer_{index}", ...),
  ipc.lifeline.die_with_parent(lifeline); attach ipc.shared_state.GroupState(shared_state_name), claim(index);
- load the tokenizer from model.model_dir without importing torch;
- connect a DEALER (identity api-<index>) to every engine address and ping each (UTILITY "ping");
- send True over `ready` once it can serve, then accept on the already-listening `listen_socket`;
- event loop beats GroupState.beat(index) every second;
- SIGTERM/SIGINT: stop accepting, let in-flight requests finish up to config.shutdown_timeout, exit code 0.
"""
