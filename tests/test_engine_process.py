"""The engine core process over ZMQ, as the supervisor and the API servers see it: READY, ping, stats, a request's
outputs routed back to the DEALER that asked, a bad request failing alone, abort, abort_client, and a prompt exit
0 on SIGTERM (last: it stops the engine the module's tests share)."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import zmq

from ipc import grammar as grammars
from ipc.codec import decode, encode
from ipc.config import ServeConfig
from ipc.launch import EngineLaunch
from ipc.messages import AbortRequests, EngineOutputs, EngineRequest, UtilityCall, UtilityResult
from ipc.model_info import EngineReady
from ipc.sampling import SamplingParams
from ipc.sockets import SUPERVISOR_IDENTITY, api_server_identity, connect_dealer, engine_address


def _recv(sock, timeout_s=60.0):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message from the engine")
    return decode(sock.recv_multipart())


def _start_engine(tmp_path_factory, **settings):
    """run_engine_core in a spawned child, as the supervisor starts it: (process, ModelInfo, zmq context, address)."""
    runtime = str(tmp_path_factory.mktemp("rt"))
    config = ServeConfig(runtime_dir=runtime, log_level="warning", **settings)
    ctx = mp.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    life_r, life_w = ctx.Pipe(duplex=False)
    from enginecore.process import run_engine_core

    proc = ctx.Process(target=run_engine_core, args=(EngineLaunch(config, 0, ready_w, life_r),))
    proc.start()
    ready_w.close()
    life_r.close()
    assert ready_r.poll(180), "engine never became ready"
    record = ready_r.recv()
    assert isinstance(record, EngineReady), record
    zctx = zmq.Context()
    yield proc, record.model, zctx, engine_address(runtime, 0)
    if proc.is_alive():
        proc.kill()
    zctx.term()
    life_w.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from _start_engine(tmp_path_factory, device="cpu", kv_cache_memory=32 * 2**20, max_model_len=1024)


@pytest.fixture(scope="module")
def simulated_engine(tmp_path_factory):
    yield from _start_engine(tmp_path_factory, model="sim:5")


def _collect(sock, done, timeout_s=120.0) -> dict:
    """Outputs read from `sock` by (request_id, index) until done(outputs) holds."""
    outputs: dict = {}
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        msg = _recv(sock, deadline - time.monotonic())
        assert isinstance(msg, EngineOutputs), msg
        for out in msg.outputs:
            outputs.setdefault((out.request_id, out.index), []).append(out)
    return outputs


def _finished(outputs, key) -> bool:
    return bool(outputs.get(key)) and outputs[key][-1].finish_reason is not None


def test_a_bad_request_fails_alone_and_the_engine_serves_on(engine):
    # As a buggy or hostile API server could send them: values the engine's code cannot take.
    proc, info, zctx, address = engine
    sock = connect_dealer(zctx, address, api_server_identity(5))
    try:
        sock.send_multipart(encode(EngineRequest("ok", list(range(10, 30)), SamplingParams(max_tokens=12,
                                                 temperature=0.0, ignore_eos=True))))
        bad_prompt = SamplingParams(max_tokens=4, n=2)
        sock.send_multipart(encode(EngineRequest("bad-add", [1, 2, "three"], bad_prompt)))
        sock.send_multipart(encode(EngineRequest("bad-sample", [1, 2, 3], SamplingParams(temperature="hot"))))
        big_seed = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1, n=2, ignore_eos=True)
        sock.send_multipart(encode(EngineRequest("big-seed", [4, 5, 6], big_seed)))
        keys = [("ok", 0), ("bad-add", 0), ("bad-add", 1), ("bad-sample", 0), ("big-seed", 0), ("big-seed", 1)]
        outputs = _collect(sock, lambda got: all(_finished(got, key) for key in keys))
        for key in [("bad-add", 0), ("bad-add", 1), ("bad-sample", 0)]:
            (out,) = outputs[key]
            assert out.finish_reason == "error" and out.error and "\n" not in out.error
        assert "prompt_token_ids" in outputs[("bad-add", 0)][0].error
        assert "temperature" in outputs[("bad-sample", 0)][0].error  # refused as it was decoded
        assert [len([t for o in outputs[("big-seed", i)] for t in o.new_token_ids]) for i in (0, 1)] == [6, 6]
        ok = outputs[("ok", 0)]
        assert sum(len(o.new_token_ids) for o in ok) == 12 and ok[-1].finish_reason == "length"
        sock.send_multipart(encode(UtilityCall(9, "ping")))
        assert _recv(sock) == UtilityResult(9, "pong") and proc.is_alive()
    finally:
        sock.close(linger=0)


def test_abort_client_stops_every_request_of_one_api_server(engine):
    proc, info, zctx, address = engine
    doomed = connect_dealer(zctx, address, api_server_identity(7))
    other = connect_dealer(zctx, address, api_server_identity(8))
    supervisor = connect_dealer(zctx, address, SUPERVISOR_IDENTITY)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        for request_id in ("a", "b"):
            doomed.send_multipart(encode(EngineRequest(request_id, list(range(20, 40)), long)))
        other.send_multipart(encode(EngineRequest("a", list(range(20, 40)), SamplingParams(
            max_tokens=48, temperature=0.0, ignore_eos=True))))  # the same request id, another API server
        first = _collect(other, lambda got: ("a", 0) in got)  # all three run
        _collect(doomed, lambda got: ("a", 0) in got and ("b", 0) in got)

        supervisor.send_multipart(encode(UtilityCall(1, "abort_client", ["api-7"])))
        assert _recv(supervisor) == UtilityResult(1, 2)
        supervisor.send_multipart(encode(UtilityCall(2, "stats")))
        stats = _recv(supervisor).result
        assert stats["num_running"] == 1 and stats["num_requests"] == 1  # api-8's request only

        rest = _collect(other, lambda got: _finished(got, ("a", 0)))
        outputs = first[("a", 0)] + rest[("a", 0)]
        assert sum(len(o.new_token_ids) for o in outputs) == 48 and outputs[-1].finish_reason == "length"
        supervisor.send_multipart(encode(UtilityCall(3, "stats")))
        stats = _recv(supervisor).result
        assert stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        while doomed.poll(0):  # what api-7 got before the abort: never a finish (nobody would read it)
            assert all(o.finish_reason is None for o in decode(doomed.recv_multipart()).outputs)
    finally:
        # On a failure, leave nothing running for the module's next test.
        doomed.send_multipart(encode(AbortRequests(["a", "b"])))
        other.send_multipart(encode(AbortRequests(["a"])))
        for sock in (doomed, other, supervisor):
            sock.close(linger=1000)


def test_a_constrained_request_through_the_loop_and_a_choice_aborted_meanwhile(engine):
    """Its grammar compiles beside the loop (most likely still compiling when the abort of choice 1 comes): choice 1
    ends with 'abort', the others run under the grammar."""
    proc, info, zctx, address = engine
    sock = connect_dealer(zctx, address, api_server_identity(4))
    try:
        sampling = SamplingParams(max_tokens=12, n=3, temperature=0.0, grammar=grammars.regex_grammar("[0-9]{4}"))
        sock.send_multipart(encode(EngineRequest("digits", list(range(10, 30)), sampling)))
        sock.send_multipart(encode(AbortRequests(["digits"], [1])))
        keys = [("digits", i) for i in range(3)]
        outputs = _collect(sock, lambda got: all(_finished(got, key) for key in keys))
        assert outputs[("digits", 1)][-1].finish_reason == "abort"
        for i in (0, 2):
            assert len([t for o in outputs[("digits", i)] for t in o.new_token_ids]) == 4  # four digits, then stop
            assert outputs[("digits", i)][-1].finish_reason == "stop"
    finally:
        sock.close(linger=0)


def test_ready_ping_generate_abort_and_sigterm(engine):
    proc, info, zctx, address = engine
    assert info.num_kv_blocks > 0 and info.eos_token_ids and info.vocab_size == 49152
    sock = connect_dealer(zctx, address, api_server_identity(3))
    try:
        sock.send_multipart(encode(UtilityCall(1, "ping")))
        assert _recv(sock) == UtilityResult(1, "pong")

        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        sock.send_multipart(encode(EngineRequest("a", [1, 2, 3, 4, 5], sp)))
        tokens, finish = [], None
        while finish is None:
            msg = _recv(sock)
            assert isinstance(msg, EngineOutputs)
            for out in msg.outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason
        assert len(tokens) == 8 and finish == "length"

        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        sock.send_multipart(encode(EngineRequest("b", list(range(10, 60)), long)))
        _recv(sock)  # its first token: it runs
        sock.send_multipart(encode(AbortRequests(["b"])))
        while True:
            msg = _recv(sock)
            if any(o.finish_reason == "abort" for o in msg.outputs):
                break
        sock.send_multipart(encode(UtilityCall(2, "stats")))
        stats = _recv(sock).result
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0

        # Idle: the loop blocks in poll, so the process uses (almost) no CPU.
        cpu_before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(proc.pid) - cpu_before < 0.1
    finally:
        sock.close(linger=0)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(15)
    assert proc.exitcode == 0 and time.monotonic() - started < 10


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_simulated_engine_runs_the_same_entry_and_loop_without_torch(simulated_engine):
    proc, info, zctx, address = simulated_engine
    assert info.device == "sim"
    with open(f"/proc/{proc.pid}/maps") as f:
        assert "libtorch" not in f.read()
    sock = connect_dealer(zctx, address, api_server_identity(2))
    try:
        sock.send_multipart(encode(EngineRequest("bad", [1, "x"], SamplingParams(max_tokens=3))))
        # A grammar is ignored: the simulated engine has no compiler and no mask (and still no torch).
        sp = SamplingParams(max_tokens=5, n=2, temperature=0.0, ignore_eos=True, grammar='{"grammars": []}')
        sock.send_multipart(encode(EngineRequest("good", [1, 2, 3], sp)))
        outputs = _collect(sock, lambda got: all(_finished(got, key) for key in [("bad", 0), ("good", 0), ("good", 1)]))
        assert outputs[("bad", 0)][-1].finish_reason == "error"
        assert [sum(len(o.new_token_ids) for o in outputs[("good", i)]) for i in (0, 1)] == [5, 5]
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "libtorch" not in f.read()
        # Idle, the loop blocks in poll (no periodic wake-ups), and a SIGTERM still stops it at once.
        cpu_before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(proc.pid) - cpu_before < 0.05
    finally:
        sock.close(linger=0)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(10)
    assert proc.exitcode == 0
