"""An API server's grammar checkers: they build and check requests' grammars in processes of their own
(apiserver/grammar_checker_process.py says why), so a grammar that crashes llguidance or runs for seconds costs
its own request a 400, and the event loop goes on serving everyone else meanwhile.

Up to `processes` of them (--structured-output-checkers), each one request at a time. The first starts with the
first grammar (a server that never sees one never has one); another starts only for a grammar that comes while
every started one is busy, so another client's slow grammar does not hold it, and a request takes a started one
when one is free. A start (a Python interpreter and llguidance, about a second, more on a busy machine) is paid by
the request that needed it, not counted in its timeout. A request that runs past `timeout` seconds
(--structured-output-check-timeout) is killed with its process, and refused; its checker starts again when next
needed. A request that finds every checker busy waits in line: the next in line for the next free checker (at most
one exchange, so at most the timeout), those behind it at most `timeout` seconds, then CheckerUnavailable (a 503 to
retry). Clients who keep every checker busy with grammars that run to the timeout would otherwise queue everyone's
structured outputs behind them without end (bench/grammar_contention.py), each request held in memory.

Verdicts are kept for the last CACHE_SIZE grammars, keyed by a digest (a grammar may be megabytes): a client that
repeats a costly one pays once, and so does one that repeats a fatal one; requests for a grammar being checked
wait for that check instead of running their own. Each exchange runs to its end even when its caller is cancelled
(a gRPC client past its deadline): a checker answers in order, and one left half done would hand its answer to the
next request, another client's grammar included.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
from collections import OrderedDict, deque

from ipc.grammar import GrammarError

log = logging.getLogger(__name__)

CACHE_SIZE = 256
# An answer is one line: a built grammar is about its request's size (at most --max-request-body-bytes) after
# JSON escaping.
_LINE_LIMIT = 1 << 30
START_TIMEOUT = 120.0  # seconds a process may take to start and say it is ready
_EXIT_WAIT_S = 5.0  # seconds a process that closed its stdout may take to exit before it is killed


class CheckerUnavailable(RuntimeError):
    """No checker can take the grammar now (none would start, or all stayed busy): not the grammar's fault, and
    nothing kept (a 503: try again)."""


class GrammarChecker:
    def __init__(self, title: str, timeout: float, processes: int = 1):
        """`title`: the processes' title; `timeout`: seconds one request may take, and may wait for a checker;
        `processes`: how many may run at once."""
        self._timeout = timeout
        self._free = [_Checker(title, timeout) for _ in range(processes)]  # not in use (started or not)
        self._line: deque[asyncio.Future] = deque()  # requests waiting for a checker
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> error, or None: it passed
        self._checking: dict[bytes, asyncio.Task] = {}  # digest -> its exchange, running (callers may be gone)

    async def build(self, kind: str, value, any_whitespace: bool = True, max_choices: int | None = None) -> str:
        """The grammar of a constraint by its name (ipc.grammar.from_constraint); GrammarError if it has none."""
        answer = await self._ask("build", [kind, value, any_whitespace, max_choices], keep_answer=False)
        return answer["grammar"]

    async def check(self, grammar: str) -> None:
        """GrammarError naming the problem, unless `grammar` compiles and takes its first step (ipc.grammar.check)."""
        await self._ask("check", [grammar], keep_answer=True)

    async def close(self) -> None:
        """Every checker's process killed (a request still at one gets its error)."""
        for checker in self._free:
            await checker.close()
        # Busy ones are killed where they are: their exchanges see the process end.
        for task in list(self._checking.values()):
            task.cancel()

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
        task = self._checking.get(digest)
        if task is None:
            task = self._checking[digest] = asyncio.ensure_future(self._answer(line, digest, keep_answer))
            task.add_done_callback(_forget_exchange(self._checking, digest))
        answer = await asyncio.shield(task)  # a cancelled caller leaves it to finish (see the module's docstring)
        error = answer.get("error")
        if error is not None:
            raise GrammarError(error)
        return answer

    async def _answer(self, line: bytes, digest: bytes, keep_answer: bool) -> dict:
        """A checker's answer to `line`, its verdict kept (all of it, or only an error)."""
        checker = await self._take()
        try:
            answer = await checker.exchange(line)
        finally:
            self._give_back(checker)
        error = answer.get("error")
        if error is not None or keep_answer:
            self._verdicts[digest] = error
            if len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return answer

    async def _take(self) -> _Checker:
        """A free checker, a started one first; else one freed while this request is next in line, or within the
        timeout from behind others (CheckerUnavailable past it)."""
        if self._free and not self._line:
            started = [checker for checker in self._free if checker.running]
            checker = started[-1] if started else self._free[-1]
            self._free.remove(checker)
            return checker
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._line.append(waiter)
        timer = loop.call_later(self._timeout, self._give_up, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_back(waiter.result())  # handed over as the caller went: not lost
            raise
        finally:
            timer.cancel()
            if waiter in self._line:
                self._line.remove(waiter)

    def _give_up(self, waiter: asyncio.Future) -> None:
        """`waiter` waited the timeout: refused, unless it is next in line (a checker's exchange ends within the
        timeout, so the next in line is served within twice that; those behind it are the ones that would wait
        for ever)."""
        if waiter.done() or (self._line and self._line[0] is waiter):
            return
        self._line.remove(waiter)
        waiter.set_exception(CheckerUnavailable(
            f"every grammar checker of this server stayed busy for {self._timeout:g} s "
            "(--structured-output-check-timeout)"))

    def _give_back(self, checker: _Checker) -> None:
        while self._line:
            waiter = self._line.popleft()
            if not waiter.done():
                waiter.set_result(checker)
                return
        self._free.append(checker)


class _Checker:
    """One checker process, started when first needed and again after a request killed it."""

    def __init__(self, title: str, timeout: float):
        self._title = title
        self._timeout = timeout
        self._process: _Process | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running

    async def close(self) -> None:
        if self._process is not None:
            await self._process.end(kill=True)
        self._process = None

    async def exchange(self, line: bytes) -> dict:
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
        except asyncio.CancelledError:  # the server closes: nothing may be left running
            await self.close()
            raise
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
            except asyncio.CancelledError:
                await process.end(kill=True)
                raise
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


def _forget_exchange(checking: dict[bytes, asyncio.Task], digest: bytes):
    def forget(task: asyncio.Task) -> None:
        if checking.get(digest) is task:
            del checking[digest]
        if not task.cancelled() and task.exception() is not None:  # retrieved: a caller that left never will
            log.debug("a grammar check failed", exc_info=task.exception())
    return forget
