"""apiserver.engine_client.EngineClient in process, against an address nobody serves (ZMQ queues the sends): what a
request that fails on its way out leaves behind."""
import asyncio

import pytest

from apiserver.engine_client import EngineClient
from ipc.sampling import SamplingParams


def test_a_request_that_cannot_be_encoded_is_not_left_in_flight(tmp_path):
    """An integer past 64 bits (orjson refuses it) that a front end let through fails the request before it
    counts: left in flight, it would skew every later choice of engine towards the others, for good."""
    async def main():
        client = EngineClient([f"ipc://{tmp_path}/nobody"], index=0)
        with pytest.raises(TypeError):
            client.generate([("bad", [1, 2, 3])], SamplingParams(max_tokens=1), priority=2**70)
        assert client.num_in_flight == 0 and client.loads.in_flight == [0]
        stream = client.generate([("bad", [1, 2, 3])], SamplingParams(max_tokens=1))  # the same id is free again
        assert client.num_in_flight == 1 and client.loads.in_flight == [1]
        client.release(stream)
        assert client.num_in_flight == 0 and client.loads.in_flight == [0]

    asyncio.run(main())
