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
        await client.close()

    asyncio.run(main())


def test_a_client_left_unclosed_is_freed_without_hanging():
    """An engine client that is dropped without close() (a test, a server that failed at start) is freed by
    reference counting: in a reference cycle it was left to the cyclic garbage collector, which clears weak
    references first, so its ZMQ context found no socket to close and waited in term() forever (a whole test
    run hung at its end). A child Python, so that a hang is a timeout here, not this process's."""
    import subprocess
    import sys

    script = ("import asyncio, gc\n"
              "from apiserver.engine_client import EngineClient\n"
              "async def main():\n"
              "    EngineClient(['tcp://127.0.0.1:9', 'ipc:///nonexistent/engine'], index=0)\n"
              "asyncio.run(main())\n"
              "gc.collect()\n"
              "print('freed')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "freed" in done.stdout, done.stderr
