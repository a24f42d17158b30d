"""The gRPC side of bench/closed_loop_clients.py: client processes that keep N Generate calls in flight against
`supervise --grpc`, as cheaply as grpcio lets a client do it.

Each simulated user has a channel (an HTTP/2 connection) of its own, as each HTTP user has its own keep-alive
connection, so the kernel's SO_REUSEPORT spreads the users over the group's gRPC API servers. Messages arrive
as raw bytes and are only counted; the last one (the GenerateComplete) is parsed for its token count.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
from smg_grpc_proto import vllm_engine_pb2 as pb

GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"
_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, never shared


def generate_body(prompt: list[int], max_tokens: int, stream: bool, ignore_eos: bool) -> bytes:
    return pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream,
        sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, n=1, temperature=0.0),
    ).SerializeToString()


async def _keep_in_flight(target: str, path: str, body: bytes, concurrency: int, duration: float,
                          expected_tokens: int, timeout: float) -> dict:
    deadline = time.monotonic() + duration
    done = Counter()
    errors = Counter()

    async def one_user() -> None:
        async with grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS) as channel:
            generate = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            while time.monotonic() < deadline:
                messages = 0
                last = b""
                try:
                    async for message in generate(body, timeout=timeout):
                        messages += 1
                        last = message
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] += 1
                    await asyncio.sleep(0.01)  # a refusing server must not turn this loop into a spin
                    continue
                complete = pb.GenerateResponse.FromString(last).complete
                done["requests"] += 1
                done["tokens"] += complete.completion_tokens or expected_tokens
                done["events"] += messages

    started = time.perf_counter()
    await asyncio.gather(*(one_user() for _ in range(concurrency)))
    return {**done, "errors": dict(errors), "wall_s": time.perf_counter() - started}


def grpc_client_process(pipe) -> None:
    """The worker of a ClosedLoopClients(worker=grpc_client_process): jobs name a `grpc://host:port` base_url."""
    loop = asyncio.new_event_loop()
    while (job := pipe.recv()) is not None:
        target = job.pop("base_url").removeprefix("grpc://")
        cpu_before = time.process_time()
        result = loop.run_until_complete(_keep_in_flight(target, **job))
        result["cpu_s"] = time.process_time() - cpu_before
        pipe.send(result)
