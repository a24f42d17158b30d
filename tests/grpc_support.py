"""`supervise --grpc` started for real, and grpcio clients made from the published proto (smg-grpc-proto)."""
from __future__ import annotations

import re
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tests.supervise_process import Supervise, title_of

_GRPC_LINE = re.compile(r"serving .* on grpc://(\S+) with")
_METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
SERVICE = "vllm.grpc.engine.VllmEngine"


class GrpcSupervise(Supervise):
    """`supervise --grpc ARGS` on a free loopback port; `target` is its host:port for grpcio."""

    def __init__(self, *args: str, env: dict | None = None):
        super().__init__("--grpc", *args, env=env)
        self.target: str | None = None
        self.metrics_url: str | None = None

    def wait_serving(self, timeout: float = 180.0) -> "GrpcSupervise":
        """Until the supervisor logged its address and the standard health service says SERVING."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervise exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            match = _GRPC_LINE.search(self.log())
            if match:
                self.target = match.group(1)
                self.url = f"grpc://{self.target}"
                metrics = _METRICS_LINE.search(self.log())
                self.metrics_url = metrics.group(1) if metrics else None
                if health_status(self.target) == health_pb2.HealthCheckResponse.SERVING:
                    return self
            time.sleep(0.2)
        raise TimeoutError(f"supervise --grpc not serving after {timeout} s:\n{self.log()[-4000:]}")

    def channel(self) -> grpc.Channel:
        """A channel of its own: its own TCP connection, so it may land on any of the API servers."""
        return grpc.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])

    def stub(self) -> pb_grpc.VllmEngineStub:
        return pb_grpc.VllmEngineStub(self.channel())

    def api_server_pids(self) -> set[int]:
        return {c.pid for c in self.children() if "ApiServer_" in title_of(c)}


def health_status(target: str, service: str = "") -> int | None:
    try:
        with grpc.insecure_channel(target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            ).status
    except grpc.RpcError:
        return None


def generate_request(prompt: list[int], request_id: str = "", stream: bool = False, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=pb.SamplingParams(**sampling),
    )


def error_of(call) -> grpc.RpcError:
    """The RpcError a call ends with (a streamed call is read to its end); fails if it succeeds."""
    try:
        result = call()
        if hasattr(result, "__next__"):  # a server stream: its status comes at its end
            list(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


class GrpcBackgroundLoad:
    """A few client threads, each on a channel (connection) of its own, sending streamed Generate calls until
    stopped; a call counts as ok when it streamed every token it asked for and finished with "length".

    A call that ends CANCELLED before its first response is sent again, as a careful client would, and counted in
    `refused`: grpc-core cancels the calls a server has received but not yet handed to its handler when its stop
    begins, though the client never cancelled them (grpc/grpc#41785; its shutdown has no second GOAWAY,
    grpc/grpc#24237). Such a call never started on the server. Any other error, or a call cut short after its
    first response, is a failure."""

    def __init__(self, server: GrpcSupervise, clients: int = 4, max_tokens: int = 20, max_seconds: float = 120.0):
        self.server = server
        self.max_tokens = max_tokens
        self.deadline = time.monotonic() + max_seconds
        self.ok = 0
        self.refused = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "GrpcBackgroundLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ok < count:
            assert time.monotonic() < deadline, f"only {self.ok} calls done; failures: {self.failures[:3]}"
            time.sleep(0.05)

    def _run(self) -> None:
        stub = self.server.stub()
        request = generate_request([1, 2, 3], stream=True, max_tokens=self.max_tokens, ignore_eos=True)
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            responses: list = []
            try:
                for response in stub.Generate(request, timeout=60):
                    responses.append(response)
                tokens = sum(len(r.chunk.token_ids) for r in responses if r.HasField("chunk"))
                finish = responses[-1].complete.finish_reason if responses else None
                outcome = None if (tokens, finish) == (self.max_tokens, "length") else f"{tokens} tokens, {finish}"
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and not responses:
                    with self._lock:
                        self.refused += 1
                    continue
                outcome = f"{exc.code()}: {exc.details()} after {len(responses)} responses"
            with self._lock:
                if outcome is None:
                    self.ok += 1
                else:
                    self.failures.append(outcome)
