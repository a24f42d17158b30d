"""--config FILE: the options of a service's settings file (YAML, vLLM's --config), the command line winning over
it. A file with a mistake is one line and exit 2 before anything starts, as a bad option is: a typo in a key is
named, not ignored (it would silently keep a default)."""
import os
import subprocess

import httpx
import pytest

from tests.supervise_process import SUPERVISE, Supervise, title_of


@pytest.mark.parametrize("text, words", [
    ("modle: sim:10\n", "'modle' is not an option of supervise"),
    ("port: [1\n", "supervise.yaml, line 2: not YAML"),
    ("max-num-seqs: abc\n", "Invalid value for '--max-num-seqs': 'abc'"),
    ("- model\n- sim:10\n", "expected option: value pairs, found a list"),
    ("max-num-seqs:\n", "'max-num-seqs' takes a whole number, and YAML reads nothing here"),
    ("config: other.yaml\n", "'config' is not an option"),
    ("grpc: true\nenable-server-load-tracking: true\n", "--enable-server-load-tracking applies to the HTTP API"),
    ("a" * (1 << 20) + ": 1\n", "not a settings file"),
    ("api-key: 0123\n", "'api-key' takes text: put it in quotes, and YAML reads 83 (int) here"),
    ("served-model-name: yes\n", "YAML reads True (bool) here"),
    ("api-server-count: 1.5\n", "'api-server-count' takes a whole number, and YAML reads 1.5 (float) here"),
    ("access-log: 1\n", "'access-log' takes true or false"),
    ("port: [8000, 8001]\n", "'port' takes a whole number, and YAML reads [8000, 8001] (list) here"),
    ("port: 1\nport: 2\n", "'port' is given twice"),
    ("max-num-seqs: 1\nmax_num_seqs: 2\n", "'max_num_seqs' is given twice (with dashes and with underscores)"),
], ids=["typo", "not-yaml", "bad-value", "a-list", "no-value", "nested-config", "conflict", "huge", "octal-key",
        "yes-name", "float-count", "int-switch", "list-port", "twice", "twice-spelled"])
def test_a_settings_file_with_a_mistake_is_one_line_before_anything_starts(tmp_path, text, words):
    path = tmp_path / "supervise.yaml"
    path.write_text(text)
    result = subprocess.run([SUPERVISE, "--config", str(path), "--port", "0"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "started" not in result.stderr


def test_one_settings_file_only(tmp_path):
    """Given twice, the first file's settings were dropped without a word."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("access-log: true\n")
    second.write_text("disable-access-log-for-endpoints: /health\n")
    result = subprocess.run([SUPERVISE, "--config", str(first), "--config", str(second)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "one settings file, not 2" in result.stderr, result.stderr


def test_a_missing_settings_file_is_named(tmp_path):
    result = subprocess.run([SUPERVISE, "--config", "/nonexistent/supervise.yaml"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and "/nonexistent/supervise.yaml: No such file or directory" in result.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened, it would wait for a writer: the start hung
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        result = subprocess.run([SUPERVISE, "--config", path], capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and f"{path}: not a regular file" in result.stderr, result.stderr


def test_a_group_serves_as_its_settings_file_says_and_the_command_line_wins(tmp_path):
    path = tmp_path / "supervise.yaml"
    path.write_text("# /etc/supervise.yaml\n"
                    "model: sim:10\n"
                    "api-server-count: 2\n"
                    "served_model_name: from-the-file\n"  # underscores as well as dashes
                    "enable-prefix-caching: false\n"
                    "allowed-origins: [https://app.example]\n"
                    "max-stop-strings: 2\n")
    with Supervise("--config", str(path), "--served-model-name", "from-the-command-line") as server:
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]] == \
            ["from-the-command-line"]
        titles = sorted(title_of(c) for c in server.children() if "ApiServer" in title_of(c))
        assert titles == ["supervise: ApiServer_0", "supervise: ApiServer_1"]
        preflight = httpx.options(f"{server.url}/v1/models", timeout=10, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
        assert preflight.headers.get("access-control-allow-origin") == "https://app.example"
        refused = httpx.post(f"{server.url}/v1/completions", timeout=10, json={
            "model": "from-the-command-line", "prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c"]})
        assert refused.status_code == 400 and "stop" in refused.json()["error"]["message"], refused.text
