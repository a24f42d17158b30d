"""apiserver.request_stream in process: what a stream's outputs count in its engine client's backlogs, on every way
they leave it. The total decides which streams --max-total-stream-backlog-mb ends, so a byte left counted after it
went would, over a server's life, end streams whose clients keep up."""
import asyncio

from apiserver.request_stream import Backlogs, RequestStream, output_bytes
from ipc.messages import RequestOutput


def _out(request_id: str, finish: str | None = None, logprobs: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [7], finish_reason=finish,
                         logprobs=[[-0.5, [[7, -0.5], [8, -1.5]]]] if logprobs else None)


def test_every_way_out_of_a_stream_takes_its_outputs_out_of_the_total():
    async def scenario():
        loop = asyncio.get_running_loop()
        backlogs = Backlogs(stream_limit=10**9, total_limit=10**9)
        to_hand: list = []
        size = output_bytes(_out("a", logprobs=True))

        # Taken by its consumer.
        a = RequestStream({"a": 0}, 1, loop, to_hand, backlogs)
        a.put(_out("a", logprobs=True))
        a.put(_out("a", logprobs=True))
        assert backlogs.total == a.backlog == 2 * size
        await a.next_batch()
        assert backlogs.total == 0

        # Held for a handler that takes them, and for one that declines them (then the consumer takes them).
        for takes in (True, False):
            b = RequestStream({"b": 0}, 1, loop, to_hand, backlogs)
            b.handler = lambda outputs, takes=takes: takes
            consumer = asyncio.ensure_future(b.next_batch())
            await asyncio.sleep(0)
            b.put(_out("b"))
            assert backlogs.total == output_bytes(_out("b")) and to_hand == [b]
            to_hand.pop().hand_over()
            if not takes:
                await consumer
            else:
                consumer.cancel()
            assert backlogs.total == 0, takes

        # Ended for its backlog: what its engines still send does not count.
        c = RequestStream({"c": 0}, 1, loop, to_hand, backlogs)
        c.put(_out("c"))
        c.overflow(RuntimeError("too slow"))
        c.put(_out("c"))
        assert backlogs.total == 0 and c.backlog == 0

        # Released by a consumer that went with outputs not taken.
        d = RequestStream({"d": 0}, 1, loop, to_hand, backlogs)
        d.put(_out("d"))
        d.put(_out("d", finish="length"))
        d.drop_backlog()  # (EngineClient.release)
        assert backlogs.total == 0

        # Past the stream's own limit `put` says so; past the total, the backlogs do.
        small = Backlogs(stream_limit=size, total_limit=3 * size)
        e = RequestStream({"e": 0}, 1, loop, to_hand, small)
        assert not e.put(_out("e", logprobs=True)) and e.put(_out("e", logprobs=True))
        f = RequestStream({"f": 0}, 1, loop, to_hand, small)
        f.put(_out("f", logprobs=True))
        assert not small.over_total
        f.put(_out("f", logprobs=True))
        assert small.over_total

    asyncio.run(scenario())


def test_without_limits_nothing_is_counted():
    async def scenario():
        backlogs = Backlogs()
        stream = RequestStream({"a": 0}, 1, asyncio.get_running_loop(), [], backlogs)
        assert not stream.put(_out("a"))
        assert backlogs.total == 0 and stream.backlog == 0

    asyncio.run(scenario())
