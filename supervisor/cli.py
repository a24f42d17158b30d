"""The `supervise` command line: every option becomes one field of ServeConfig."""
from __future__ import annotations

import json
import os
import sys

import click

from ipc.config import METRICS_NAMES, REASONING_PARSERS, TOOL_CALL_PARSERS, ServeConfig
from supervisor.config_file import load_config_file

_DEFAULTS = ServeConfig()


def _list_option(click_context, param, value):
    """A JSON list (as vLLM takes it) or a comma-separated list -> a tuple of strings."""
    if value is None:
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise click.BadParameter(f"not a JSON list: {exc}") from exc
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise click.BadParameter("expected a JSON list of strings")
        return tuple(items)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _chat_template(click_context, param, value):
    """A file's text, or the template itself (vLLM takes both); its Jinja syntax is checked now, not per request."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise click.BadParameter(f"{value!r} is neither a file nor a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise click.BadParameter(f"not a valid Jinja template: {exc.message} (line {exc.lineno})") from exc
    return text


# Run in a child Python: the supervisor itself imports none of the user's code (it lives as long as the group,
# and a middleware module may import anything, torch included); the API servers build it the same way.
_MIDDLEWARE_CHECK = """import json, sys
sys.path[:] = json.loads(sys.argv[2])  # the supervisor's, as the API servers get it (not `-c`'s current directory)
try:
    from apiserver.middleware import user_middleware
    user_middleware(sys.argv[1])
except BaseException as exc:
    print(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__)
    sys.exit(1)
"""


def _api_keys(click_context, param, value: tuple[str, ...]) -> tuple[str, ...]:
    if not value and "SUPERVISE_API_KEY" in os.environ:
        # `Environment=SUPERVISE_API_KEY=$KEY` with KEY unset: serving without a key would be nobody's intent.
        raise click.BadParameter("SUPERVISE_API_KEY is set but holds no key (unset it to serve without one)")
    for key in value:
        if not key or key != key.strip() or any(c.isspace() for c in key) or not key.isprintable():
            raise click.BadParameter("a key is one word of printable characters (a client sends it in a header)")
    return value


def _paths(click_context, param, value: str) -> tuple[str, ...]:
    """Request paths, without a trailing slash: this server's routes have none (`/v1/models/` would never match)."""
    paths = tuple(path.strip() for path in value.split(",") if path.strip())
    for path in paths:
        if not path.startswith("/"):
            raise click.BadParameter(f"{path!r} is not a path (one starts with /)")
    return tuple(path.rstrip("/") or "/" for path in paths)


def _middleware(click_context, param, value):
    """Each MODULE:OBJECT is imported and checked now, in a child Python, as an API server will build it: a module
    that is not there or an object that is not a class or a function was each API server's traceback, after the
    model had loaded, exit 1 (and a reload at every restart by the service manager)."""
    import subprocess

    for spec in value:
        try:
            done = subprocess.run([sys.executable, "-c", _MIDDLEWARE_CHECK, spec, json.dumps(sys.path)],
                                  capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise click.BadParameter(f"{spec!r}: importing it took over 120 s") from None
        if done.returncode != 0:
            reason = done.stdout.strip() or (done.stderr.strip().splitlines() or ["it could not be imported"])[-1]
            raise click.BadParameter(f"{spec!r}: {reason}")
    return value


def _host(click_context, param, value):
    """An empty --host would listen on every interface, as a bind to "" does: say so instead (it is more often
    an unset variable, `--host "$HOST"`, than a wish)."""
    if not value.strip():
        raise click.BadParameter("is empty; to listen on every interface say so: 0.0.0.0 (or :: for IPv6)")
    return value


def _positive(click_context, param, value):
    if value is not None and value <= 0:
        raise click.BadParameter("must be greater than 0")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--config", metavar="FILE", multiple=True, is_eager=True, expose_value=False, callback=load_config_file,
              help="Read options from a YAML file of `option-name: value` pairs (vLLM's --config); the command "
                   "line wins over it. A key that is no option is refused.")
@click.option("--host", default=_DEFAULTS.host, show_default=True, callback=_host,
              help="Address to listen on (an IP address of this machine or a host name; 0.0.0.0: every interface).")
@click.option("--port", default=_DEFAULTS.port, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port to listen on (0: any free port, printed in the log).")
@click.option("--model", default=None,
              help="A local Hugging Face model directory, a .gguf file, or a hub id. "
                   "Default: the embedded SmolLM2-135M-Instruct. `sim:<ms>` starts the simulated engine, "
                   "a benchmark instrument that paces tokens without a model.")
@click.option("--served-model-name", default=None,
              help="The model name clients send and /v1/models lists. Default: derived from --model.")
@click.option("--api-server-count", default=_DEFAULTS.api_server_count, show_default=True,
              type=click.IntRange(1, 64), help="API server processes sharing the listening socket.")
@click.option("--data-parallel-size", default=_DEFAULTS.data_parallel_size, show_default=True,
              type=click.IntRange(1, 64), help="Engine cores, one per GPU (or one on the CPU).")
@click.option("--data-parallel-size-local", default=None, type=click.IntRange(0, 64),
              help="Engine cores on this node. Default: all of --data-parallel-size (one node). On a head, the "
                   "other ranks register from --headless nodes.")
@click.option("--data-parallel-start-rank", default=_DEFAULTS.data_parallel_start_rank, show_default=True,
              type=click.IntRange(0, 63), help="The first rank this --headless node runs.")
@click.option("--data-parallel-rank", default=None, type=click.IntRange(0, 63),
              help="External balancing: this group serves rank N alone (one engine, its own port), for a router "
                   "in front of --data-parallel-size such groups.")
@click.option("--data-parallel-address", default=_DEFAULTS.data_parallel_address, show_default=True,
              help="The head's address: its registration port listens there, and headless nodes reach it there.")
@click.option("--data-parallel-rpc-port", default=_DEFAULTS.data_parallel_rpc_port, show_default=True,
              type=click.IntRange(1, 65535), help="The head's registration port (TCP).")
@click.option("--headless", is_flag=True,
              help="Run engine cores only (no API servers, no HTTP port) and register them with the head.")
@click.option("--data-parallel-engine-port", default=_DEFAULTS.data_parallel_engine_port, show_default=True,
              type=click.IntRange(0, 65535),
              help="--headless: the TCP port of this node's first engine core, the next ones count up (0: free ports).")
@click.option("--data-parallel-engine-host", default=None,
              help="--headless: the address this node's engine cores listen on. Default: this machine's address "
                   "on the route to the head.")
@click.option("--data-parallel-key-file", default=None, type=click.Path(dir_okay=False),
              help="A file holding the deployment's secret (32+ characters, the same on every node): engine and "
                   "registration ports on TCP then admit only its holders (ZMQ CURVE). Or set "
                   "SUPERVISE_DATA_PARALLEL_KEY. Make one with: openssl rand -hex 32 > dp.key")
@click.option("--max-model-len", default=None, type=int, callback=_positive,
              help="Longest prompt + output in tokens. Default: the model's own limit.")
@click.option("--dtype", default=_DEFAULTS.dtype, show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Weights and activations: auto is float32 on the CPU, bfloat16 on CUDA.")
@click.option("--quantization", "-q", default=_DEFAULTS.quantization, show_default=True,
              type=click.Choice(["auto", "none", "bf16", "int8"]),
              help="Matrix products on the CPU (the rest stays float32): none (float32 weights), bf16 (bfloat16 "
                   "weights and inputs), int8 (8-bit weights by our kernel, built with the machine's C compiler: "
                   "codes per block of 32 columns that hold a GGUF's weights exactly, two to a byte where a "
                   "block has 16 values (Q4_1, Q4_0), float32 activations; or "
                   "oneDNN's, per channel, where that is much faster). auto: for a GGUF model (the embedded one) "
                   "the most accurate mode that beats float32 by 10% at start-up (int8 by our kernel, else bf16 "
                   "where the CPU has native bfloat16, else oneDNN's int8); otherwise none. See README.")
@click.option("--load-format", default=_DEFAULTS.load_format, show_default=True,
              type=click.Choice(["auto", "dummy"]),
              help="auto: load the model's weights; dummy: random weights built from its config.json on the "
                   "device, nothing read from disk (a tokenizer is made when the directory has none).")
@click.option("--device", default=_DEFAULTS.device, show_default=True,
              help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N.")
@click.option("--max-num-seqs", default=_DEFAULTS.max_num_seqs, show_default=True, type=click.IntRange(1),
              help="Most sequences in one engine step; a request's n choices count too (those past a free slot "
                   "wait for one).")
@click.option("--max-num-batched-tokens", default=_DEFAULTS.max_num_batched_tokens, show_default=True,
              type=click.IntRange(1), help="Token budget of one engine step (long prompts go in chunks).")
@click.option("--long-prefill-token-threshold", default=None, type=click.IntRange(0), metavar="TOKENS",
              help="While other sequences run or wait, one prompt's chunk takes at most this many tokens of a step "
                   "(vLLM's option), so that a long prompt does not hold up every request after it for its whole "
                   "prefill. Default: a quarter of --max-num-batched-tokens; 0: no cap.")
@click.option("--block-size", default=_DEFAULTS.block_size, show_default=True, type=click.IntRange(1),
              help="Tokens per KV cache block.")
@click.option("--kv-cache-memory", default=None, type=int, callback=_positive,
              help="Bytes of KV cache on the CPU. Default: a share of free memory.")
@click.option("--gpu-memory-utilization", default=_DEFAULTS.gpu_memory_utilization, show_default=True,
              type=click.FloatRange(0.05, 1.0), help="Share of GPU memory for weights + KV cache.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Share the KV blocks of repeated prompt prefixes.")
@click.option("--scheduling-policy", default=_DEFAULTS.scheduling_policy, show_default=True,
              type=click.Choice(["fcfs", "priority"]),
              help="Order of waiting requests: arrival, or the request's priority first. Either way a request's "
                   "k-th sequence (choice, or prompt of one request) waits as if it came k sequences later, so one "
                   "request cannot hold every slot.")
@click.option("--enforce-eager", is_flag=True, help="CUDA: no CUDA graphs.")
@click.option("--cuda-graph-max-tokens", default=_DEFAULTS.cuda_graph_max_tokens, show_default=True,
              type=click.IntRange(0),
              help="CUDA: a step with prompt tokens (new requests' prefills beside running decodes) replays a CUDA "
                   "graph of its layers when it has at most this many tokens; 0: only decode-only steps do. Needs "
                   "varlen attention (CUDA, half precision; see --attention-backend) and a Llama-architecture model.")
@click.option("--attention-backend", default=_DEFAULTS.attention_backend, show_default=True,
              type=click.Choice(["auto", "flash", "triton"]),
              help="CUDA in half precision: the attention kernel. flash: every context's K/V gathered from the "
                   "cache, then torch's flash varlen kernel; triton: a paged kernel that reads the cache blocks "
                   "where they lie; auto: each must match a reference at start-up, and decode-only steps and steps "
                   "with prompt tokens each take the one faster on a step of that kind timed there. Elsewhere "
                   "attention runs per sequence with SDPA (only auto is accepted).")
@click.option("--async-scheduling/--no-async-scheduling", default=None,
              help="Schedule and prepare the next step while the device computes this one (the outputs of a "
                   "step go out during the next). [default: on for CUDA, off on the CPU]")
@click.option("--seed", default=_DEFAULTS.seed, show_default=True, type=int, help="Engine random seed.")
@click.option("--engine-ready-timeout", default=_DEFAULTS.engine_ready_timeout, show_default=True,
              type=click.FloatRange(1), help="Seconds the engine cores may take to load the model.")
@click.option("--api-server-ready-timeout", default=_DEFAULTS.api_server_ready_timeout, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds an API server may take to start serving (then it is killed).")
@click.option("--shutdown-timeout", default=_DEFAULTS.shutdown_timeout, show_default=True,
              type=click.FloatRange(0),
              help="Seconds in-flight requests may take to finish on SIGTERM (a --headless node's ranks' too: the "
                   "head sends them no new request meanwhile).")
@click.option("--heartbeat-timeout", default=_DEFAULTS.heartbeat_timeout, show_default=True,
              type=click.FloatRange(0.5), help="An API server silent this long is killed and replaced.")
@click.option("--max-restarts", default=_DEFAULTS.max_restarts, show_default=True, type=click.IntRange(0),
              help="API server restarts allowed within --restart-window before the group goes down.")
@click.option("--restart-window", default=_DEFAULTS.restart_window, show_default=True,
              type=click.FloatRange(1), help="Seconds over which --max-restarts counts.")
@click.option("--on-engine-failure", default=_DEFAULTS.on_engine_failure, show_default=True,
              type=click.Choice(["exit", "restart"]),
              help="exit: the group goes down (systemd restarts it); restart: restart the group in place "
                   "(at most --max-engine-restarts times within --engine-restart-window).")
@click.option("--max-engine-restarts", default=_DEFAULTS.max_engine_restarts, show_default=True,
              type=click.IntRange(0),
              help="With --on-engine-failure restart: group restarts allowed within --engine-restart-window; one "
                   "more engine failure then takes the group down (exit 1), so an engine that keeps dying, or a "
                   "request that kills it each time a client retries, cannot keep the group loading forever.")
@click.option("--engine-restart-window", default=_DEFAULTS.engine_restart_window, show_default=True,
              type=click.FloatRange(1), help="Seconds over which --max-engine-restarts counts.")
@click.option("--accept-backoff-ms", default=_DEFAULTS.accept_backoff_ms, show_default=True,
              type=click.FloatRange(0), help="How long a busier API server lets idler ones take a connection.")
@click.option("--write-batching/--no-write-batching", default=_DEFAULTS.write_batching,
              help="API servers make the socket writes of one event-loop pass together, after its Python work "
                   "(a streamed token's event about a fifth cheaper; a write waits at most for the rest of "
                   "that pass); --no-write-batching writes each at once. [default: on]")
@click.option("--direct-stream-events/--no-direct-stream-events", default=_DEFAULTS.direct_stream_events,
              help="API servers write a streamed response's events straight to its connection, past the ASGI "
                   "send chain, and while the response waits, the engine output reader writes them itself (no "
                   "task wake-up per token); off where --middleware is given, which may change a body. "
                   "--no-direct-stream-events sends every event through the app's send. [default: on]")
@click.option("--timeout-keep-alive", default=_DEFAULTS.timeout_keep_alive, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Close a connection that brings no request this many seconds (after connecting or after "
                   "its last response).")
@click.option("--timeout-request-header", default=_DEFAULTS.timeout_request_header, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds a request's headers may take in all, and its body between two reads; then 408 and "
                   "the connection is closed. Also a TLS handshake's bound (with --grpc, only that).")
@click.option("--engine-ping-interval", default=_DEFAULTS.engine_ping_interval, show_default=True,
              type=click.FloatRange(0.1), help="Seconds between an API server's pings of each engine: one "
              "unanswered this long turns /health to 503, three in a row fail that rank's requests (and stop the API "
              "server when no other rank answers); the supervisor pings its "
              "own engines too and kills one that leaves a ping unanswered for five intervals (an engine failure).")
@click.option("--engine-step-timeout", default=_DEFAULTS.engine_step_timeout, show_default=True,
              type=click.FloatRange(0, min_open=True),
              help="Seconds one engine step may run before the engine counts as wedged: it then stops answering "
                   "pings, and the API servers take it for gone (see --engine-ping-interval). A busy engine "
                   "answers pings during its steps; keep this above your longest step (a long prompt's prefill "
                   "chunk on a CPU may take a minute).")
@click.option("--log-stats-interval", default=_DEFAULTS.log_stats_interval, show_default=True,
              type=click.FloatRange(0),
              help="Seconds between each engine's line of activity in the log while it works: steps (and how many "
                   "ran from CUDA graphs), ms a step, prompt and generated tokens/s, running and waiting "
                   "requests, KV cache use. 0: no such lines.")
@click.option("--api-key", multiple=True, envvar="SUPERVISE_API_KEY", show_envvar=True, callback=_api_keys,
              help="Require `Authorization: Bearer <key>` on every route that reaches the model or its tokenizer. "
                   "Repeat it to accept several keys (a rotation: old and new at once); the environment variable "
                   "takes them separated by spaces.")
@click.option("--allowed-origins", default="[]", show_default=True, callback=_list_option,
              help='CORS: allowed origins, a JSON list or comma-separated ("*": any). Default: none.')
@click.option("--allowed-methods", default='["*"]', show_default=True, callback=_list_option,
              help="CORS: allowed methods, a JSON list or comma-separated.")
@click.option("--allowed-headers", default='["*"]', show_default=True, callback=_list_option,
              help="CORS: allowed request headers, a JSON list or comma-separated.")
@click.option("--allow-credentials", is_flag=True, help="CORS: allow credentials (cookies, Authorization).")
@click.option("--enable-request-id-headers", is_flag=True,
              help="Answer every request with an X-Request-Id header (the client's, or a new one).")
@click.option("--disable-docs", is_flag=True, help="Do not serve /openapi.json and /docs.")
@click.option("--sse-keep-alive-interval", default=None, type=click.FloatRange(0, min_open=True),
              help="Streams idle this many seconds get a `: keep-alive` comment.")
@click.option("--max-num-queued-reqs", default=None, type=click.IntRange(1),
              help="Most requests admitted at once over the whole group; more get HTTP 503.")
@click.option("--max-num-queued-tokens", default=None, type=click.IntRange(1),
              help="Most prompt tokens admitted at once over the whole group; more get HTTP 503 (a "
                   "request larger than the limit alone gets 400).")
@click.option("--max-request-body-bytes", default=_DEFAULTS.max_request_body_bytes, show_default=True,
              type=click.IntRange(1), help="Largest request body; a larger one gets HTTP 413 before it is parsed.")
@click.option("--max-large-request-bodies-mb", default=_DEFAULTS.max_large_request_bodies_mb, show_default=True,
              type=click.IntRange(0),
              help="MB of request bodies of 1 MiB or more one API server holds at once, counted as their bytes "
                   "are read, until their requests end (a parsed chat of many messages weighs some 27 times its "
                   "body); a body past it gets HTTP 503, unread when its Content-Length says so. With --grpc: "
                   "request messages, and RESOURCE_EXHAUSTED. 0: no limit.")
@click.option("--max-request-header-bytes", default=_DEFAULTS.max_request_header_bytes, show_default=True,
              type=click.IntRange(1024), help="Most bytes of URL and header lines one request may send; more get HTTP "
                                              "431 and the connection closes.")
@click.option("--max-structured-output-choices", default=_DEFAULTS.max_structured_output_choices, show_default=True,
              type=click.IntRange(1), help="Most strings a structured output's `choice` may list; more get HTTP 400.")
@click.option("--structured-output-check-timeout", default=_DEFAULTS.structured_output_check_timeout,
              show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds an API server may spend building and checking one request's structured-output grammar "
                   "(in a process of its own); past them the request gets HTTP 400. A request that finds every "
                   "checker busy for as long gets HTTP 503 to retry.")
@click.option("--structured-output-checkers", default=_DEFAULTS.structured_output_checkers, show_default=True,
              type=click.IntRange(1, 64),
              help="Grammar checker processes each API server may run at once (about 25 MB each), one grammar at a "
                   "time each: another starts only for a grammar that comes while all are busy.")
@click.option("--max-stop-strings", default=_DEFAULTS.max_stop_strings, show_default=True, type=click.IntRange(0),
              help="Most stop strings a request may give (OpenAI takes 4); more get HTTP 400. Each is looked for in "
                   "every token's text, so thousands would slow every stream of the API server. 0: no limit.")
@click.option("--max-stop-string-chars", default=_DEFAULTS.max_stop_string_chars, show_default=True,
              type=click.IntRange(0),
              help="Most characters a request's stop strings may hold in all; more get HTTP 400. Looking for one in "
                   "a token's text costs about its length, in the API server's event loop. 0: no limit.")
@click.option("--grammar-cache-size", default=_DEFAULTS.grammar_cache_size, show_default=True, type=click.IntRange(1),
              help="Compiled structured-output grammars each engine keeps for requests that repeat them (most weigh "
                   "tens of KB, the largest some 9 MB).")
@click.option("--max-stream-backlog-mb", default=_DEFAULTS.max_stream_backlog_mb, show_default=True,
              type=click.IntRange(0),
              help="Most output (MB, estimated) a stream may hold in its API server for a client that reads slower "
                   "than the engine writes; past it the request is aborted and the stream ends with an error "
                   "(gRPC: RESOURCE_EXHAUSTED). 0: no limit.")
@click.option("--max-total-stream-backlog-mb", default=_DEFAULTS.max_total_stream_backlog_mb, show_default=True,
              type=click.IntRange(0),
              help="Most output (MB, estimated) all streams together may hold in one API server for clients that "
                   "read slower than the engine writes; past it the streams that hold most are aborted as above. "
                   "0: no limit.")
@click.option("--max-logprob-entries", default=_DEFAULTS.max_logprob_entries, show_default=True,
              type=click.IntRange(0),
              help="Most logprob entries (tokens x (1 + top logprobs), over every choice) a response that is not "
                   "streamed may hold (a Responses API one streamed too: its last event is the whole response); a "
                   "request that could need more gets HTTP 400 (stream it instead). 0: no limit.")
@click.option("--max-logit-bias-entries", default=_DEFAULTS.max_logit_bias_entries, show_default=True,
              type=click.IntRange(0),
              help="Most tokens a request's `logit_bias` may give a bias to; more get HTTP 400 (gRPC: "
                   "INVALID_ARGUMENT). The engine adds each to its request's logits in every step. 0: no limit.")
@click.option("--max-echo-tokens", default=_DEFAULTS.max_echo_tokens, show_default=True, type=click.IntRange(0),
              help="Most prompt tokens a completion with `echo` may send back over all its choices (n x the "
                   "prompts' tokens); more get HTTP 400. 0: no limit.")
@click.option("--enable-prompt-tokens-details", is_flag=True,
              help="Report cached prompt tokens in usage.prompt_tokens_details.")
@click.option("--enable-tokenizer-info-endpoint", is_flag=True, help="Serve GET /tokenizer_info.")
@click.option("--enable-server-load-tracking", is_flag=True, help="Count in-flight requests for GET /load.")
@click.option("--access-log", is_flag=True,
              help="Log one line per HTTP request once it is answered, as uvicorn's access log (vLLM's default): "
                   "client, request line, status, seconds taken (a stream's at its end). Off by default: each line "
                   "costs the request CPU time.")
@click.option("--disable-access-log-for-endpoints", metavar="PATHS", callback=_paths, default="",
              help="With --access-log: paths left out of it, comma-separated (e.g. /health,/metrics,/ping; vLLM's "
                   "option).")
@click.option("--middleware", multiple=True, metavar="MODULE:OBJECT", callback=_middleware,
              help="Extra ASGI middleware (a class, or `async def f(request, call_next)`); repeatable, "
                   "outermost first. Each is imported once at start-up to check it (a child Python), then in "
                   "every API server.")
@click.option("--grpc", is_flag=True,
              help="Serve gRPC instead of HTTP on --port: the vllm.grpc.engine.VllmEngine service of smg-grpc-proto "
                   "(token ids in and out), for a gateway such as smg that tokenizes itself.")
@click.option("--ssl-certfile", default=None, metavar="PEM",
              help="Serve HTTPS (or gRPC over TLS) on --port with this certificate (chain), its key in --ssl-keyfile "
                   "or in the same file.")
@click.option("--ssl-keyfile", default=None, metavar="PEM", help="The certificate's private key (no passphrase).")
@click.option("--ssl-ca-certs", default=None, metavar="PEM",
              help="CA certificates that client certificates must chain to (with --ssl-cert-reqs 1 or 2).")
@click.option("--ssl-cert-reqs", default=_DEFAULTS.ssl_cert_reqs, show_default=True, type=click.IntRange(0, 2),
              help="Client certificates: 0 not asked for, 1 checked when given, 2 required (mutual TLS).")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535),
              help="With --grpc: serve Prometheus metrics (the whole group's) at http://HOST:PORT/metrics.")
@click.option("--metrics-names", default=_DEFAULTS.metrics_names, show_default=True, type=click.Choice(METRICS_NAMES),
              help="The names /metrics gives. vllm: vLLM's (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
                   "vllm:time_to_first_token_seconds, ...) for the series that mean the same, for what reads those: "
                   "vLLM's dashboards, the Gateway API Inference Extension, autoscalers; the others keep supervise_.")
@click.option("--chat-template", default=None, callback=_chat_template,
              help="The chat template to render messages with, instead of the model's: a file, or the template "
                   "itself. templates/tool_chat_template_hermes.jinja gives the embedded model tools and thinking.")
@click.option("--tokenizer-word-cache/--no-tokenizer-word-cache", default=_DEFAULTS.tokenizer_word_cache,
              help="API servers tokenize plain and mostly-ASCII text themselves, for byte-level BPE tokenizers "
                   "(GPT-2's kind: Llama 3, Qwen 2, SmolLM2...), with the tokenizer's own ids and 5-10x faster; "
                   "--no-tokenizer-word-cache leaves all text to the Rust tokenizer. [default: on]")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help='Serve tool_choice "auto" (the default when a request has tools): the model decides, and '
                   "--tool-call-parser finds its calls.")
@click.option("--tool-call-parser", default=None, type=click.Choice(TOOL_CALL_PARSERS),
              help="How the model writes tool calls (needed by --enable-auto-tool-choice).")
@click.option("--reasoning-parser", default=None, type=click.Choice(REASONING_PARSERS),
              help="Split <think>...</think> reasoning into reasoning_content (deepseek_r1: every output starts in "
                   "it; qwen3: when the output or the prompt opens it).")
@click.option("--log-level", default=_DEFAULTS.log_level, show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(**options) -> None:
    """Serve an OpenAI-compatible API for a language model from a supervised group of processes.

    \b
    Example:  supervise --api-server-count 4 --port 8000
    Then:     curl http://127.0.0.1:8000/v1/models
    """
    config = build_config(options)
    if config.headless:
        from supervisor.headless import serve_headless as serve
    else:
        from supervisor.serve import serve  # after parsing: `--help` stays instant
    from supervisor.signals import ignore_from_now

    code = serve(config)
    ignore_from_now()
    sys.exit(code)


def build_config(options: dict) -> ServeConfig:
    from ipc.tls import tls_problem
    from supervisor.grpc_mode import option_conflict
    from supervisor.layout import BadLayout, layout_of

    if options.get("enable_auto_tool_choice") and not options.get("tool_call_parser"):
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser")
    if options.get("disable_access_log_for_endpoints") and not options.get("access_log"):
        raise click.UsageError("--disable-access-log-for-endpoints goes with --access-log (off by default here)")
    config = ServeConfig(**options)
    try:
        layout_of(config)
    except BadLayout as exc:
        raise click.UsageError(str(exc)) from None
    conflict = option_conflict(config) or tls_problem(config)
    if conflict:
        raise click.UsageError(conflict)
    return config


if __name__ == "__main__":
    main()
