"""The CPU engine's thread governor (enginecore.cpu_threads.ThreadGovernor) on scripted readings: every core
while they are free (or nearly: API servers beside it), fewer once a neighbour takes one, every core again when it
leaves; a change only when AGREE readings in a row ask for it; never fewer than one thread or more than the
usable cores."""
from enginecore.cpu_threads import ThreadGovernor


class Machine:
    """Scripted clock, process CPU seconds and machine idle seconds: each interval, the cores this process used and
    the cores that sat idle."""

    def __init__(self):
        self.now = self.cpu = self.idle = 0.0
        self.set_calls: list[int] = []

    def advance(self, own: float, idle: float, seconds: float = ThreadGovernor.INTERVAL * 1.01) -> None:
        self.now += seconds
        self.cpu += own * seconds
        self.idle += idle * seconds

    def governor(self, cores: int) -> ThreadGovernor:
        return ThreadGovernor(cores, lambda: self.idle, clock=lambda: self.now, cpu_seconds=lambda: self.cpu,
                              set_threads=self.set_calls.append)


def run(machine: Machine, governor: ThreadGovernor, own: float, idle: float, intervals: int = 1) -> int:
    for _ in range(intervals):
        machine.advance(own, idle)
        governor.tick()
    return governor.threads


def test_follows_a_neighbour_that_takes_a_core_and_leaves():
    m = Machine()
    g = m.governor(2)
    agree = ThreadGovernor.AGREE
    assert run(m, g, own=2.0, idle=0.0, intervals=3) == 2  # alone, busy: every core
    assert run(m, g, own=1.7, idle=0.0, intervals=5) == 2  # API servers beside it take a few tenths
    assert run(m, g, own=1.0, idle=0.0, intervals=agree - 1) == 2  # fewer readings than AGREE are not enough
    assert run(m, g, own=1.0, idle=0.0) == 1  # AGREE of them: a neighbour holds a core
    assert run(m, g, own=1.0, idle=0.0, intervals=5) == 1  # steady beside it
    assert run(m, g, own=1.0, idle=1.0, intervals=agree) == 2  # it left: the idle core comes back
    assert m.set_calls == [1, 2]


def test_an_idle_engine_keeps_every_core():
    m = Machine()
    g = m.governor(4)
    assert run(m, g, own=0.02, idle=3.98, intervals=6) == 4
    assert m.set_calls == []


def test_bounds_and_flapping():
    m = Machine()
    g = m.governor(2)
    agree = ThreadGovernor.AGREE
    assert run(m, g, own=0.3, idle=0.0, intervals=agree) == 1  # starved: still one thread, never zero
    assert run(m, g, own=1.0, idle=8.0, intervals=agree) == 2  # a big machine's idle cores: no more than usable
    for own, idle in [(1.0, 0.0), (2.0, 0.0)] * 3:  # readings that disagree change nothing
        assert run(m, g, own=own, idle=idle) == 2
    assert m.set_calls == [1, 2]


def test_reads_nothing_between_intervals():
    m = Machine()
    g = m.governor(2)
    for _ in range(10):  # many steps within one interval
        m.advance(own=1.0, idle=0.0, seconds=ThreadGovernor.INTERVAL / 20)
        g.tick()
    assert g._wanted == []
