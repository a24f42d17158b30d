"""The engine core process over ZMQ, as the supervisor and the API servers see it: READY, ping, stats, a request's
outputs routed back to the DEALER that asked, abort, and a prompt exit 0 on SIGTERM."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import zmq

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


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    runtime = str(tmp_path_factory.mktemp("rt"))
    config = ServeConfig(runtime_dir=runtime, device="cpu", kv_cache_memory=32 * 2**20, max_model_len=1024,
                         log_level="warning")
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


def test_abort_client_drops_every_request_of_a_gone_api_server(engine):
    # What the supervisor asks when an API server is gone: its requests stop, another server's run on.
    proc, info, zctx, address = engine
    gone = connect_dealer(zctx, address, api_server_identity(7))
    other = connect_dealer(zctx, address, api_server_identity(8))
    supervisor = connect_dealer(zctx, address, SUPERVISOR_IDENTITY)
    try:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        for i in range(3):
            gone.send_multipart(encode(EngineRequest(f"g{i}", [1, 2, 3, 4, i + 5], long)))
        other.send_multipart(encode(EngineRequest("o", [7, 8, 9], long)))
        assert isinstance(_recv(other), EngineOutputs)  # everything is queued or running now
        supervisor.send_multipart(encode(UtilityCall(1, "abort_client", ["api-7"])))
        assert _recv(supervisor) == UtilityResult(1, 3)
        supervisor.send_multipart(encode(UtilityCall(2, "stats")))
        stats = _recv(supervisor).result
        assert stats["num_requests"] == 1 and stats["num_running"] + stats["num_waiting"] == 1
        other.send_multipart(encode(AbortRequests(["o"])))
    finally:
        for sock in (gone, other, supervisor):
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
