"""Start the real `supervise` command on a free loopback port and drive it as an operator would."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

SUPERVISE = os.path.join(os.path.dirname(sys.executable), "supervise")


def model_cache_without_native_builds(where) -> str:
    """A copy of the model cache ($XDG_CACHE_HOME/supervise) under `where`, without the C kernels already built for
    this CPU: the XDG_CACHE_HOME of a first start on a machine that has the model."""
    import shutil

    shutil.copytree(os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "supervise"),
                    os.path.join(where, "supervise"), ignore=shutil.ignore_patterns("native"))
    return str(where)


_URL_LINE = re.compile(r"serving .* on (https?://\S+) with")


class Supervise:
    def __init__(self, *args: str, env: dict | None = None, port: int = 0, prefix: list[str] = (),
                 verify: str | bool = True):
        """`prefix`: a command to run it under (e.g. `ip netns exec NAME`); `verify`: httpx's, for an https group
        (the CA's PEM file)."""
        self.verify = verify
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="supervise-", suffix=".log", delete=False)
        self.args = [*prefix, SUPERVISE, "--host", "127.0.0.1", "--port", str(port), *args]
        self.proc = subprocess.Popen(
            self.args, stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
        )
        self.url: str | None = None

    def __enter__(self) -> "Supervise":
        """`with Supervise(...) as server:` serves inside the block and leaves nothing behind after it."""
        try:
            return self.wait_serving()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_file.name) as f:
            return f.read()

    def wait_serving(self, timeout: float = 180.0) -> "Supervise":
        """Until the supervisor logged its URL and /health answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervise exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.url is None:
                match = _URL_LINE.search(self.log())
                if match:
                    self.url = match.group(1)
            if self.url is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"supervise not serving after {timeout} s:\n{self.log()[-4000:]}")

    def wait_health(self, status: int = 200, timeout: float = 10.0) -> httpx.Response:
        """Until /health answers `status` (connection errors meanwhile are retried); its last answer."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if r.status_code == status:
                    return r
                seen = r.status_code
            except httpx.HTTPError as exc:
                seen = repr(exc)
            assert time.monotonic() < deadline, f"/health: {seen}, not {status}\n{self.log()[-3000:]}"
            time.sleep(0.1)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) for raw sockets."""
        host, port = self.url.rsplit("//", 1)[1].rsplit(":", 1)
        return host, int(port)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child_titled(self, title: str) -> psutil.Process:
        for child in self.children():
            if title_of(child) == f"supervise: {title}":
                return child
        raise LookupError(f"no child titled {title!r} among {[c.pid for c in self.children()]}")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        """SIGTERM, then make sure nothing of the group is left, whatever happened in the test."""
        descendants = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.log_file.close()
        return self.proc.returncode


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a helper process (a gateway, a router), SIGKILL it if it outlives `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def runtime_dir_of(api_server: psutil.Process) -> str:
    """The group's runtime directory, where the API server's metrics file lies."""
    (path,) = {m.path for m in api_server.memory_maps() if os.path.basename(m.path).startswith("metrics-")}
    return os.path.dirname(path)


def title_of(process: psutil.Process) -> str:
    """The process title as `ps` shows it (setproctitle pads the command line with spaces)."""
    try:
        return " ".join(process.cmdline()).strip()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after `timeout` seconds."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_for(predicate, timeout: float, what: str, *logs_of):
    """Poll `predicate` until it returns something true (returned); fail after `timeout` s with the logs of
    `logs_of` (Supervise-likes) in the message."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(p.log()[-3000:] for p in logs_of)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)
