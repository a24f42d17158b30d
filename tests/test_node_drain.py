"""When a draining node may leave, decided against a fake clock (tests/test_dp_node_drain.py runs it for real)."""
from supervisor.node_drain import ACK_WAIT, SETTLE, NodeDrain

IDLE = {"num_running": 0, "num_waiting": 0, "num_requests": 0}
BUSY = {"num_running": 1, "num_waiting": 0, "num_requests": 1}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_answer_counts_only_when_asked_a_settle_after_the_head_acknowledged():
    clock = Clock()
    drain = NodeDrain([1, 2], timeout=30, head_silent=False, clock=clock)
    asked = clock.now
    assert not drain.drained({1: (asked, IDLE), 2: (asked, IDLE)})  # the head has not marked the ranks yet
    clock.now += 0.1
    drain.head_answered()
    early = clock.now + SETTLE / 2  # a request sent before the mark may still be on its way then
    assert not drain.drained({1: (early, IDLE), 2: (early, IDLE)})
    clock.now += SETTLE
    late = clock.now
    assert not drain.drained({1: (late, IDLE), 2: (late, BUSY)})
    assert not drain.drained({1: (late, IDLE)})  # rank 2 has not answered
    assert drain.drained({1: (late, IDLE), 2: (late, IDLE)})
    assert drain.unfinished({1: (late, IDLE), 2: (late, BUSY)}) == 1


def test_a_head_that_never_answers_is_waited_for_a_while_and_a_silent_one_not_at_all():
    clock = Clock()
    drain = NodeDrain([1], timeout=30, head_silent=False, clock=clock)
    clock.now += ACK_WAIT
    assert drain.drained({1: (clock.now, IDLE)})
    silent = NodeDrain([1], timeout=30, head_silent=True, clock=clock)
    assert silent.drained({1: (clock.now, IDLE)})


def test_the_drain_times_out():
    clock = Clock()
    drain = NodeDrain([1], timeout=5, head_silent=True, clock=clock)
    clock.now += 4.9
    assert not drain.timed_out()
    clock.now += 0.1
    assert drain.timed_out()
