"""What an operator sees when `supervise` cannot start: one clear line and a meaningful exit code."""
import os
import socket
import subprocess

import pytest

from tests.supervise_process import SUPERVISE


def run_supervise(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([SUPERVISE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("stranger_reuses_port", [False, True], ids=["plain", "reuseport"])
def test_port_taken_by_another_process_is_refused_at_once(stranger_reuses_port):
    # A stranger that also set SO_REUSEPORT would silently share the port with a plain SO_REUSEPORT bind.
    other = socket.socket()
    if stranger_reuses_port:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        result = run_supervise("--port", str(port), "--model", "sim:5", timeout=30)
    finally:
        other.close()
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--host", "999.1.1.1"], "not an IP address, nor a host name that resolves"),
    (["--host", "not-a-host.invalid"], "not an IP address, nor a host name that resolves"),
    (["--host", "192.0.2.1"], "not an address of this machine"),  # TEST-NET-1: never an interface's
    (["--host", ""], "--host"),
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
])
def test_an_address_to_listen_on_that_cannot_be_is_one_line_and_exit_code_2(args, words):
    result = run_supervise("--model", "sim:5", *args, timeout=30)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(("supervise: error:", "Error:"))]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [
    ["--max-request-header-bytes", "10"], ["--max-stop-strings", "-1"], ["--structured-output-check-timeout", "0"],
    ["--structured-output-checkers", "0"], ["--structured-output-checkers", "65"],
    ["--max-large-request-bodies-mb", "-1"], ["--max-total-stream-backlog-mb", "-1"],
    ["--grammar-cache-size", "0"], ["--max-echo-tokens", "-5"],
], ids=lambda args: args[0])
def test_a_limit_out_of_its_range_is_one_line_and_exit_code_2(args):
    result = run_supervise("--model", "sim:5", *args, timeout=30)
    assert result.returncode == 2, result.stderr
    assert args[0] in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("fds, fd3, words", [("abc", None, "not a count"), ("1", "file", "is not a socket")])
def test_a_broken_socket_activation_is_one_line_and_exit_code_2(tmp_path, fds, fd3, words):
    """LISTEN_PID names this process (systemd socket activation) but LISTEN_FDS is no count, or descriptor 3 is a
    plain file: the environment is wrong, said in one line, as a bad option is."""
    plain = open(tmp_path / "not-a-socket", "w")
    result = subprocess.run(
        ["sh", "-c", f'LISTEN_PID=$$ LISTEN_FDS={fds} exec "$0" "$@"', SUPERVISE, "--model", "sim:5", "--port", "0"],
        preexec_fn=(lambda: os.dup2(plain.fileno(), 3)) if fd3 else None, close_fds=False,
        capture_output=True, text=True, timeout=60,
    )
    plain.close()
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("supervise: error:")]
    assert len(errors) == 1 and "LISTEN_FDS" in errors[0] and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_is_one_line_and_exit_code_2(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_supervise("--port", "0", "--model", str(missing))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("supervise: error:")]
    assert len(errors) == 1 and str(missing) in errors[0]


def test_a_model_cache_that_cannot_be_written_is_one_line_and_exit_code_2(tmp_path):
    """The embedded model is converted into $XDG_CACHE_HOME/supervise on a first start: where that cannot be
    made (here a path under a file, as /dev/null/cache), the engine's traceback was all an operator got, exit 1."""
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_bytes(b"")
    result = subprocess.run([SUPERVISE, "--port", "0"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "XDG_CACHE_HOME": str(not_a_directory / "cache")})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("supervise: error:")]
    assert len(errors) == 1 and "cannot write the model cache" in errors[0] and "XDG_CACHE_HOME" in errors[0]


def test_a_file_that_is_not_a_model_is_named_as_such(tmp_path):
    plain = tmp_path / "weights.bin"
    plain.write_bytes(b"not a model")
    result = run_supervise("--port", "0", "--model", str(plain))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("supervise: error:")]
    assert errors == [f"supervise: error: {plain} is a file, not a model directory or a .gguf file"]


def test_directory_that_is_not_a_model_is_refused(tmp_path):
    result = run_supervise("--port", "0", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "config.json" in result.stderr
    assert "Traceback" not in result.stderr


def broken_copy_of_the_embedded_model(where, broken: str, content: bytes) -> str:
    """The embedded model's directory (as converted) with links to its files, but `broken` written as `content`."""
    from enginecore.model_source import resolve_model

    source = resolve_model(None)
    os.makedirs(where)
    for name in os.listdir(source):
        if name != broken:
            os.symlink(os.path.join(source, name), os.path.join(where, name))
    with open(os.path.join(where, broken), "wb") as f:
        f.write(content)
    return str(where)


@pytest.mark.parametrize("broken, content, words", [
    ("model.safetensors", b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\"", "cannot load"),  # truncated in its header
    ("tokenizer.json", b'{"version": "1.0", "model": ', "cannot read the tokenizer"),
    ("tokenizer_config.json", b"{not json", "cannot read"),
])
def test_a_corrupt_model_file_is_one_line_and_exit_code_2(tmp_path, broken, content, words):
    """A truncated weights file was a traceback through transformers, exit 1; a corrupt tokenizer file the API
    servers' traceback once the whole model had loaded, exit 1 (and a reload at every restart by systemd)."""
    model = broken_copy_of_the_embedded_model(tmp_path / "model", broken, content)
    result = run_supervise("--port", "0", "--model", model)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("supervise: error:")]
    assert len(errors) == 1 and words in errors[0] and broken in errors[0], errors


@pytest.mark.parametrize("args,flag", [
    (("--api-server-count", "0"), "--api-server-count"),
    (("--log-stats-interval", "-1"), "--log-stats-interval"),
    (("--log-stats-interval", "soon"), "--log-stats-interval"),
    (("--async-scheduling=yes",), "--async-scheduling"),
    (("--cuda-graph-max-tokens", "-8"), "--cuda-graph-max-tokens"),
    (("--attention-backend", "xformers"), "--attention-backend"),
    (("--api-key", ""), "--api-key"),  # `--api-key "$KEY"` with KEY unset: not "no key"
    (("--api-key", "two words"), "--api-key"),
    (("--disable-access-log-for-endpoints", "/health"), "--disable-access-log-for-endpoints goes with --access-log"),
    (("--access-log", "--disable-access-log-for-endpoints", "health"), "--disable-access-log-for-endpoints"),
])
def test_bad_option_values_are_refused_before_anything_starts(args, flag):
    result = run_supervise(*args, timeout=30)
    assert result.returncode == 2
    assert flag in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("blank", ["", " ", "\t "])
def test_a_blank_api_key_in_the_environment_is_refused(blank):
    """It left the group open, without a word (an unset variable in a unit's Environment= line)."""
    result = run_supervise("--model", "sim:10", env={"SUPERVISE_API_KEY": blank}, timeout=30)
    assert result.returncode == 2 and "SUPERVISE_API_KEY is set but holds no key" in result.stderr, result.stderr


def test_help_explains_the_options():
    result = run_supervise("--help", timeout=30)
    assert result.returncode == 0
    for option in ("--api-server-count", "--model", "--max-model-len", "--dtype", "--device", "--shutdown-timeout"):
        assert option in result.stdout


@pytest.mark.parametrize("args, words", [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nonesuch"], "--tool-call-parser"),
    (["--reasoning-parser", "nonesuch"], "--reasoning-parser"),
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% for %}"], "not a valid Jinja template"),
    # Each API server's traceback after the model had loaded, exit 1, before they were checked at the start.
    (["--middleware", "nonexistent.module:obj"], "No module named 'nonexistent'"),
    (["--middleware", "os:path"], "neither a class nor a function"),
    (["--middleware", "os:nope"], "has no attribute 'nope'"),
    (["--middleware", "tests.test_api_middleware"], "expected module:object"),
])
def test_chat_options_are_checked_before_anything_starts(args, words):
    result = run_supervise("--model", "sim:5", *args, timeout=30)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr


def test_help_lists_the_chat_options():
    result = run_supervise("--help", timeout=30)
    for option in ("--chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
                   "hermes", "llama3_json", "pythonic", "deepseek_r1", "qwen3"):
        assert option in result.stdout


def test_an_attention_kernel_the_engine_cannot_run_is_refused():
    """--attention-backend flash or triton on the CPU (in float32): one line that says why, exit code 2."""
    tiny = os.path.join(os.path.dirname(__file__), "models", "tiny-llama")
    result = run_supervise("--port", "0", "--model", tiny, "--load-format", "dummy", "--attention-backend", "triton")
    assert result.returncode == 2, result.stderr
    assert "--attention-backend triton needs CUDA in half precision; this engine runs on cpu in float32" in result.stderr
    assert "Traceback" not in result.stderr
