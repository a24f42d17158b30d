"""One ServeConfig for the whole group: parsed once by the supervisor, handed to every child.

It is a frozen dataclass so it pickles into `spawn`ed children unchanged and nobody edits it on the way.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from dataclasses import dataclass


# An engine that leaves this many --engine-ping-interval's in a row unanswered is gone: each API server stops
# (apiserver/engine_watch.py), and the supervisor that started it kills it two intervals later
# (supervisor/engine_liveness.py).
MISSED_PINGS_FOR_GONE = 3


@dataclass(frozen=True)
class ServeConfig:
    # Where and what to serve.
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    served_model_name: str | None = None
    api_server_count: int = 1
    data_parallel_size: int = 1
    log_level: str = "info"

    # Engine core.
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on CUDA
    quantization: str = "auto"  # auto | none | bf16 | int8 (CPU); auto: measured at start-up for a GGUF model, else none
    load_format: str = "auto"  # auto: the model's weights | dummy: random weights from config.json (benchmarks)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The most tokens one prompt's chunk takes of a step while other sequences run or wait (enginecore/scheduler.py);
    # None: a quarter of max_num_batched_tokens; 0: no cap (a long prompt takes every step's budget, vLLM's default).
    long_prefill_token_threshold: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes, CPU only; None: a share of free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    # CUDA: a step with prompt tokens replays a CUDA graph of its layers when it has at most this many tokens in
    # all (0: only decode-only steps replay graphs). Where varlen attention (either kernel) and the lean forward
    # run.
    cuda_graph_max_tokens: int = 1024
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU
    # CUDA, half precision: the kernel of a step's attention: auto (each kind of step the faster of the two at
    # start-up) | flash (gather + flash varlen) | triton (paged, reads the cache blocks where they lie).
    attention_backend: str = "auto"
    seed: int = 0
    engine_ready_timeout: float = 600.0
    # One engine step running longer than this is a wedged engine: it stops answering pings (its API servers then
    # take it for gone, as a frozen one). Generous: a long prefill chunk on a CPU may take a minute.
    engine_step_timeout: float = 300.0
    # Seconds between the engine's lines of activity in the log while it works (steps, tokens/s, load); 0: none.
    log_stats_interval: float = 10.0

    # API servers.
    api_key: tuple[str, ...] = ()  # any of them is accepted (apiserver/api_keys.py)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    disable_docs: bool = False
    sse_keep_alive_interval: float | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    max_request_body_bytes: int = 8 * 1024 * 1024
    # MB of large request bodies (apiserver.validation.LARGE_BODY_BYTES and up) one API server holds at once, by
    # bytes read, until their requests end: the requests they make weigh some 27 times as much while they are
    # parsed and rendered (a chat of 250,000 empty messages, 7.9 MB, held about 210 MB: bench/large_bodies.py), so
    # a client sending many at once could take an API server out of memory. A body past it gets 503 (gRPC request
    # messages: RESOURCE_EXHAUSTED). 0: no limit.
    max_large_request_bodies_mb: int = 32
    # The most bytes of URL and header lines one request may send (431 past it): httptools has no limit of its
    # own (nginx allows 32 KB, Node 16 KB).
    max_request_header_bytes: int = 64 * 1024
    # The most strings a structured output's `choice` may list (a 400 past it): the API server's grammar checker
    # builds and checks the list's grammar and the engine compiles it, each some milliseconds per thousand strings.
    max_structured_output_choices: int = 10_000
    # Seconds an API server's grammar checker may take over one request's grammar (building and checking it, in a
    # process of its own: apiserver/grammar_checker.py); past them it is refused. Real schemas take milliseconds.
    structured_output_check_timeout: float = 5.0
    # Grammar checker processes an API server may run at once, each one request at a time: the second starts only
    # for a grammar that comes while the first is busy, so one client's slow grammar does not hold every request.
    structured_output_checkers: int = 2
    # The most stop strings a request may give (a 400 past it; OpenAI takes 4): an API server looks for each in every
    # new token's text, in its event loop. 0: no limit.
    max_stop_strings: int = 64
    # The most characters a request's stop strings may hold in all (a 400 past it): looking for one in a token's text
    # costs about its length (64 of 20,000 characters on 16 choices of 8,000 tokens: 23 s of an API server's CPU
    # against 1.6 s without). 0: no limit.
    max_stop_string_chars: int = 8192
    # Compiled structured-output grammars each engine keeps (enginecore.grammar_compiler says what they weigh).
    grammar_cache_size: int = 64
    # A streamed response's outputs that wait in the API server for a client that reads slower than the engine
    # writes (or not at all), in MB as estimated (apiserver.request_stream.output_bytes); past it the request is
    # aborted. 0: no limit.
    max_stream_backlog_mb: int = 64
    # All streams' outputs waiting for their clients in one API server, in MB as estimated: past it the streams that
    # hold most are aborted (clients that stop reading, each under the limit above, add up). 0: no limit.
    max_total_stream_backlog_mb: int = 512
    # The most logprob entries (a token's, and each of its top logprobs) a response that is not streamed may hold
    # (apiserver.sampling_params.check_whole_logprobs): some 400 MB of an API server's memory. 0: no limit.
    max_logprob_entries: int = 1_000_000
    # The most prompt tokens a completion's `echo` may repeat over its choices (n x the prompts' tokens): each is
    # the prompt's text again in the response (apiserver.sampling_params.check_echo). 0: no limit.
    max_echo_tokens: int = 4_194_304
    # The most entries a request's logit_bias may give (a 400 past it): the engine adds each to its row's logits
    # in every step, and keeps them on the device while the request runs. 0: no limit (the vocabulary's size).
    max_logit_bias_entries: int = 1024
    enable_prompt_tokens_details: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    access_log: bool = False  # one line per HTTP request (apiserver.access_log)
    disable_access_log_for_endpoints: tuple[str, ...] = ()  # paths left out of it (vLLM's option)
    middleware: tuple[str, ...] = ()  # "module:object" ASGI middleware, outermost first
    timeout_keep_alive: float = 5.0  # uvicorn's name and default: an idle connection is closed after this
    write_batching: bool = True  # an API server makes a loop pass's socket writes together (apiserver.write_batch)
    direct_stream_events: bool = True  # streamed events written straight to the connection (apiserver.direct_body)
    # TLS on --port (ipc.tls): a PEM certificate (chain) and its key; CA certificates and whether to ask clients for
    # a certificate (0 no, 1 optional, 2 required: Python's ssl.CERT_* values).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    timeout_request_header: float = 30.0  # a request's headers (in total) or its body (between reads): else 408
    engine_ping_interval: float = 5.0  # a ping unanswered this long turns /health to 503; MISSED_PINGS_FOR_GONE: gone
    grpc: bool = False  # serve vllm.grpc.engine.VllmEngine (smg-grpc-proto) on `port` instead of HTTP
    metrics_port: int | None = None  # --grpc: Prometheus metrics over HTTP here, since gRPC has no /metrics
    metrics_names: str = "supervise"  # one of METRICS_NAMES: "vllm" gives vLLM's names where ours mean the same
    # Chat: tools and reasoning (vLLM's options).
    chat_template: str | None = None  # the template's text (--chat-template names a file or gives the text)
    tokenizer_word_cache: bool = True  # API servers tokenize plain ASCII text with their word cache (apiserver.word_cache)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # one of REASONING_PARSERS

    # Supervisor.
    shutdown_timeout: float = 30.0
    heartbeat_timeout: float = 10.0
    api_server_ready_timeout: float = 120.0
    accept_backoff_ms: float = 5.0
    max_restarts: int = 5
    restart_window: float = 60.0
    on_engine_failure: str = "exit"  # exit | restart
    max_engine_restarts: int = 3  # --on-engine-failure restart: group restarts allowed within engine_restart_window
    engine_restart_window: float = 600.0

    # Data parallelism across machines (vLLM's names; supervisor/layout.py reads them into one layout).
    data_parallel_size_local: int | None = None  # engine cores on this node; None: all of them (one node)
    data_parallel_start_rank: int = 0  # the first rank this node runs (headless nodes)
    data_parallel_rank: int | None = None  # external balancing: this group serves this one rank
    data_parallel_address: str = "127.0.0.1"  # the head's address: its registration port listens there
    data_parallel_rpc_port: int = 13345  # the head's registration port
    data_parallel_engine_port: int = 0  # first TCP port of this node's engine cores (0: any free ports)
    data_parallel_engine_host: str | None = None  # where a headless node's engines listen; None: toward the head
    data_parallel_key_file: str | None = None  # the shared CURVE key of the engine ports (ipc/curve.py)
    headless: bool = False  # engine cores only, registered with the head

    # Filled in by the supervisor at start-up, not by the user.
    runtime_dir: str = ""

    def replace(self, **changes: Any) -> "ServeConfig":
        return dataclasses.replace(self, **changes)

    @property
    def long_prefill_tokens(self) -> int:
        """--long-prefill-token-threshold as the scheduler takes it: a number of tokens, 0 for no cap."""
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_token_threshold

    @property
    def model_name(self) -> str:
        """The name clients must send in `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return EMBEDDED_MODEL_NAME
        return self.model.rstrip("/")


EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Named here, where the supervisor's command line can list them without importing the API servers' parsers.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
METRICS_NAMES = ("supervise", "vllm")
