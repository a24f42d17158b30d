"""An API server's grammar checker: builds and checks requests' grammars in a process of its own
(apiserver/grammar_checker_process.py says why), so a grammar that crashes llguidance or runs for seconds costs
its own request a 400, and the event loop goes on serving everyone else meanwhile.

The process starts with the first grammar (a server that never sees one never has it) and again after one killed
it; its start-up (a Python interpreter and llguidance, seconds on a busy machine) is not counted in any request's
time. It takes one request at a time; one that runs past `timeout` seconds (--structured-output-check-timeout) is
killed with its process, and refused. Verdicts are kept for the last CACHE_SIZE grammars, keyed by a digest (a
grammar may be megabytes): a client that repeats a costly one pays once, and so does one that repeats a fatal one.

Answers come in the order of the requests, so each exchange runs to its end even when its caller is cancelled (a
gRPC client past its deadline): left half done, its answer was read by the next request, and every request after
it took the answer of the one before, another client's grammar included.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
from collections import OrderedDict

from ipc.grammar import GrammarError

log = logging.getLogger(__name__)

CACHE_SIZE = 256
# An answer is one line: a built grammar is about its request's size (at most --max-request-body-bytes) after
# JSON escaping.
_LINE_LIMIT = 1 << 30
START_TIMEOUT = 120.0  # seconds the process may take to start and say it is ready
_EXIT_WAIT_S = 5.0  # seconds a process that closed its stdout may take to exit before it is killed


class CheckerUnavailable(RuntimeError):
    """The checker process would not start: not the grammar's fault, and nothing kept (a 503: try again)."""


class GrammarChecker:
    def __init__(self, title: str, timeout: float):
        """`title`: the process's title; `timeout`: seconds one request may take."""
        self._title = title
        self._timeout = timeout
        self._process: _Process | None = None
        self._lock = asyncio.Lock()  # one request at a time: answers come in order
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> error, or None: it passed
        self._exchanges: set[asyncio.Task] = set()  # running on after their callers were cancelled

    async def build(self, kind: str, value, any_whitespace: bool = True, max_choices: int | None = None) -> str:
        """The grammar of a constraint by its name (ipc.grammar.from_constraint); GrammarError if it has none."""
        answer = await self._ask("build", [kind, value, any_whitespace, max_choices], keep_answer=False)
        return answer["grammar"]

    async def check(self, grammar: str) -> None:
        """GrammarError naming the problem, unless `grammar` compiles and takes its first step (ipc.grammar.check)."""
        await self._ask("check", [grammar], keep_answer=True)

    async def close(self) -> None:
        if self._process is not None:
            await self._process.end(kill=True)
        self._process = None

    async def _ask(self, op: str, args: list, keep_answer: bool) -> dict:
        """The process's answer; GrammarError for an error. `keep_answer`: keep the verdict, not only an error."""
        try:
            line = json.dumps({"op": op, "args": args}).encode() + b"\n"
        except (ValueError, RecursionError):  # a schema nested past json's recursion limit
            raise GrammarError("the schema is nested too deeply") from None
        digest = hashlib.sha256(line).digest()
        if digest in self._verdicts:  # a check's verdict, or a build's error
            self._verdicts.move_to_end(digest)
            error = self._verdicts[digest]
            if error is not None:
                raise GrammarError(error)
            return {"ok": True}
        task = asyncio.ensure_future(self._answer(line, digest, keep_answer))
        self._exchanges.add(task)
        task.add_done_callback(_forget_exchange(self._exchanges))
        answer = await asyncio.shield(task)  # a cancelled caller leaves it to finish (see the module's docstring)
        error = answer.get("error")
        if error is not None:
            raise GrammarError(error)
        return answer

    async def _answer(self, line: bytes, digest: bytes, keep_answer: bool) -> dict:
        """The process's answer to `line`, its verdict kept (all of it, or only an error)."""
        async with self._lock:
            answer = await self._exchange(line)
        error = answer.get("error")
        if error is not None or keep_answer:
            self._verdicts[digest] = error
            if len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return answer

    async def _exchange(self, line: bytes) -> dict:
        """The process's answer to `line`; an error for a request that killed it or ran past the timeout."""
        process = await self._running()
        try:
            process.stdin.write(line)
            await asyncio.wait_for(process.stdin.drain(), self._timeout)
            reply = await asyncio.wait_for(process.stdout.readline(), self._timeout)
        except asyncio.TimeoutError:
            await self.close()
            return {"error": f"it took more than {self._timeout:g} s to check (--structured-output-check-timeout)"}
        except (BrokenPipeError, ConnectionResetError):
            reply = b""
        if not reply:
            code = await process.end(kill=False)
            self._process = None
            log.warning("the grammar checker died (%s) on a request's grammar, which is refused", _exit_status(code))
            return {"error": "it crashed the grammar compiler (nested or chained too deeply?)"}
        return json.loads(reply)

    async def _running(self) -> _Process:
        if self._process is None or not self._process.running:
            process = await _Process.start(self._title)
            try:
                ready = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
            except asyncio.TimeoutError:
                ready = b""
            if json.loads(ready or b"{}").get("ready") is not True:
                code = await process.end(kill=True)
                log.error("the grammar checker did not start (%s)", _exit_status(code))
                raise CheckerUnavailable("the grammar checker did not start")
            self._process = process
        return self._process


class _Process:
    """The checker's process, its stdin and stdout as asyncio streams.

    Started by `subprocess`, not by asyncio's create_subprocess_exec: under uvloop that forks the API server, its
    threads' state and all, and runs Python's after-fork code in the copy before exec. In a gRPC API server (gRPC's
    poller threads at work) the copy crashed before it could run the checker, a SIGSEGV or a SIGABRT in gRPC's
    epoll poller, in 6 starts of 300 under load (bench/checker_start.py), and that request failed INTERNAL.
    `subprocess` starts the process with vfork and exec, running nothing of ours or of gRPC's in between."""

    def __init__(self, popen: subprocess.Popen, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader,
                 stdout_transport: asyncio.ReadTransport):
        self._popen = popen
        self.stdin = stdin
        self.stdout = stdout
        self._stdout_transport = stdout_transport

    @classmethod
    async def start(cls, title: str) -> _Process:
        """CheckerUnavailable when the system refuses it (out of file descriptors, of memory, of processes)."""
        try:
            popen = subprocess.Popen([sys.executable, "-m", "apiserver.grammar_checker_process", title],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as exc:
            log.error("the grammar checker could not be started: %s", exc)
            raise CheckerUnavailable(f"the grammar checker could not be started ({exc.strerror or exc})") from None
        loop = asyncio.get_running_loop()
        stdout = asyncio.StreamReader(limit=_LINE_LIMIT)
        try:
            stdout_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout),
                                                               popen.stdout)
            stdin_transport, stdin_protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                                            popen.stdin)
        except BaseException:  # no checker is left running that nothing could reach
            popen.kill()
            await asyncio.to_thread(popen.wait)
            raise
        stdin = asyncio.StreamWriter(stdin_transport, stdin_protocol, None, loop)
        return cls(popen, stdin, stdout, stdout_transport)

    @property
    def running(self) -> bool:
        return self._popen.poll() is None

    async def end(self, kill: bool) -> int:
        """Its exit code (minus the signal that ended it), once it has exited: at once with `kill`, else after at
        most _EXIT_WAIT_S of its own."""
        self.stdin.close()
        self._stdout_transport.close()
        if not kill:
            try:  # it closed its stdout: it is exiting, or stuck, which must not hold the next grammar for ever
                return await asyncio.to_thread(self._popen.wait, _EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self._popen.kill()  # nothing when it is already gone
        return await asyncio.to_thread(self._popen.wait)


def _exit_status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _forget_exchange(exchanges: set[asyncio.Task]):
    def forget(task: asyncio.Task) -> None:
        exchanges.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved: a caller that left never will
            log.debug("a grammar check failed", exc_info=task.exception())
    return forget
