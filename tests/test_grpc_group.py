"""`supervise --grpc` as a group: the port, the API key, the admission limits, and the operator's signals, with
gRPC API servers restarted, rolled and drained like the HTTP ones."""
import signal
import socket
import subprocess

import grpc
import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from tests.grpc_support import GrpcBackgroundLoad, GrpcSupervise, error_of, generate_request
from tests.supervise_process import SUPERVISE, wait_for, wait_gone

KEY = (("authorization", "Bearer sekrit"),)


def test_options_of_the_http_api_are_refused_with_grpc():
    result = subprocess.run([SUPERVISE, "--grpc", "--allowed-origins", "*"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--allowed-origins applies to the HTTP API" in result.stderr
    result = subprocess.run([SUPERVISE, "--metrics-port", "9100"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--metrics-port goes with --grpc" in result.stderr


def test_a_busy_port_is_refused_at_once():
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        result = subprocess.run([SUPERVISE, "--grpc", "--port", str(port), "--model", "sim:5"],
                                capture_output=True, text=True, timeout=30)
    finally:
        other.close()
    assert result.returncode == 1 and f"127.0.0.1:{port} is already in use" in result.stderr


def test_api_key_metadata_and_group_wide_admission():
    with GrpcSupervise("--model", "sim:10", "--api-key", "old-key", "--api-key", "sekrit", "--max-num-queued-reqs",
                       "1") as server:
        stub = server.stub()
        # Either key (a rotation under way) is taken.
        (done,) = stub.Generate(generate_request([1, 2], max_tokens=1), metadata=(("authorization", "Bearer old-key"),))
        assert done.complete.finish_reason == "length"
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sekrit"),),
                         (("authorization", "Bearer wrong"), ("authorization", "Bearer sekrit"))):
            for call in (lambda: stub.Generate(generate_request([1, 2], max_tokens=1), metadata=metadata),
                         lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)):
                error = error_of(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in error.details()
        assert stub.HealthCheck(pb.HealthCheckRequest()).healthy  # probes need no key
        long_call = stub.Generate(generate_request([1, 2], stream=True, max_tokens=5000, ignore_eos=True),
                                  metadata=KEY)
        assert next(long_call).HasField("chunk")
        error = error_of(lambda: server.stub().Generate(generate_request([1, 2], max_tokens=1), metadata=KEY))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 1 queued requests" in error.details()
        long_call.cancel()
        wait_for(lambda: not server.stub().GetLoads(pb.GetLoadsRequest(), metadata=KEY).loads[0].num_running_reqs,
                   5, "the cancelled call to leave the engine", server)
        (done,) = stub.Generate(generate_request([1, 2], max_tokens=2), metadata=KEY)
        assert done.complete.finish_reason == "length"


@pytest.fixture(scope="module")
def group():
    with GrpcSupervise("--model", "sim:10", "--api-server-count", "2", "--heartbeat-timeout", "3") as server:
        yield server


def test_a_frozen_grpc_server_is_replaced_by_its_missing_heartbeat(group):
    """The heartbeat comes from the server's event loop: SIGSTOP silences it, and the supervisor replaces it."""
    before = group.api_server_pids()
    victim = sorted(before)[-1]
    subprocess.run(["kill", "-STOP", str(victim)], check=True)
    wait_for(lambda: victim not in group.api_server_pids() and len(group.api_server_pids()) == 2, 30,
               "the frozen server to be replaced", group)
    assert "has not beaten for" in group.log()


def test_a_killed_grpc_server_is_replaced(group):
    before = group.api_server_pids()
    victim = sorted(before)[0]
    subprocess.run(["kill", "-9", str(victim)], check=True)
    wait_for(lambda: len(group.api_server_pids() - before) == 1 and len(group.api_server_pids()) == 2, 30,
               "a replacement", group)
    wait_for(lambda: group.log().count(" ready") >= 1 and "died" in group.log(), 30, "the restart log", group)
    for _ in range(4):  # new connections reach both servers, the replacement included
        (response,) = group.stub().Generate(generate_request([1, 2], max_tokens=2))
        assert response.complete.finish_reason == "length"


def test_sighup_rolls_every_grpc_server_without_a_failed_call(group):
    before = group.api_server_pids()
    with GrpcBackgroundLoad(group, clients=4, max_tokens=30) as load:
        load.wait_for(8)
        group.signal(signal.SIGHUP)
        wait_for(lambda: "rolling restart done" in group.log(), 60, "the rolling restart", group)
        wait_for(lambda: not (group.api_server_pids() & before), 30, "the old servers to exit", group)
        done_at_restart = load.ok
        load.wait_for(done_at_restart + 8)
    assert load.failures == []
    assert load.refused <= 2 * 4  # grpc-core's race at each old server's stop: at most a call per client each
    assert len(group.api_server_pids()) == 2


def test_sigterm_lets_a_running_stream_finish(group):
    servers = [c for c in group.children()]
    call = group.stub().Generate(generate_request([1, 2], stream=True, max_tokens=150, ignore_eos=True))
    assert next(call).HasField("chunk")
    group.signal(signal.SIGTERM)
    rest = list(call)
    assert sum(len(r.chunk.token_ids) for r in rest if r.HasField("chunk")) == 149
    assert rest[-1].complete.finish_reason == "length" and len(rest[-1].complete.output_ids) == 150
    assert group.wait_exit(30) == 0
    assert wait_gone(servers, 10) == []


def test_data_parallel_ranks_are_pinned_by_field_or_metadata_and_reported_by_get_loads():
    def sent_to_ranks(server) -> list[float]:
        text = httpx.get(server.metrics_url, timeout=5).text
        return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("supervise_engine_requests_total{")]

    with GrpcSupervise("--model", "sim:5", "--data-parallel-size", "2", "--api-server-count", "2",
                       "--metrics-port", "0") as server:
        stub = server.stub()
        assert sent_to_ranks(server) == [0, 0]
        for _rank, field, metadata in ((1, 1, ()), (1, None, (("x-data-parallel-rank", "1"),)), (0, 0, ())):
            request = generate_request([5, 6, 7], max_tokens=3)
            if field is not None:
                request.data_parallel_rank = field
            assert list(stub.Generate(request, metadata=metadata))[-1].complete.finish_reason == "length"
        assert sent_to_ranks(server) == [1, 2]  # each where it was pinned
        loads = stub.GetLoads(pb.GetLoadsRequest())
        assert loads.dp_rank_count == 2 and [load.dp_rank for load in loads.loads] == [0, 1]
        assert [load.dp_rank for load in stub.GetLoads(pb.GetLoadsRequest(dp_rank=1)).loads] == [1]
        for metadata in ((("x-data-parallel-rank", "2"),), (("x-data-parallel-rank", "one"),)):
            error = error_of(lambda: stub.Generate(generate_request([5], max_tokens=1), metadata=metadata))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert sent_to_ranks(server) == [1, 2]
