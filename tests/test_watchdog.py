"""The watchdog's decisions, driven event by event against a fake group and a fake clock (no processes), as
gunicorn tests its arbiter. The end-to-end tests (test_group_*.py) run the same code with real processes."""
import logging
import signal
import time
from types import SimpleNamespace

import pytest

from ipc.config import ServeConfig
from supervisor.children import Child
from supervisor.events import ChildExited, ChildReady, SignalArrived, TimerFired, Timers
from supervisor.group import ProcessGroup
from supervisor.restart_policy import RestartBudget
from supervisor.watchdog import ENGINE_FAILURE_GRACE, ROLL_END_POLL, ROLL_END_LIMIT, Outcome, Watchdog

SIGKILLED = -signal.SIGKILL


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeGroup:
    """The group's verbs, recorded instead of done."""

    free_api_index = ProcessGroup.free_api_index  # pure bookkeeping: the real one
    engine_link = None  # no engines to ping

    def __init__(self, config: ServeConfig, clock: Clock):
        self.config = config
        self.clock = clock
        self.calls: list[tuple] = []
        self.engines = [self._child("engine", 0, ready=True)]
        self.api_servers = {i: self._child("api", i, ready=True) for i in range(config.api_server_count)}
        self.draining: list[Child] = []
        self.last_beat = {i: clock() for i in self.api_servers}
        self.listening: set[str] = set()  # drained servers whose SIGTERM has not reached their event loop yet

    def _child(self, kind: str, index: int, ready: bool = False) -> Child:
        name = f"EngineCore_DP{index}" if kind == "engine" else f"ApiServer_{index}"
        process = SimpleNamespace(exitcode=None, pid=None, sentinel=None)
        return Child(name, kind, index, process, None, None, started_at=self.clock(), ready=ready)

    def children(self):
        return [*self.engines, *self.api_servers.values(), *self.draining]

    def spawn_api_server(self, index, replaces=None):
        self.calls.append(("spawn", index, replaces))
        child = self.api_servers[index] = self._child("api", index)
        child.replaces = replaces
        self.last_beat[index] = self.clock()
        return child

    def replace(self, old_index, reserved=()):
        return self.spawn_api_server(self.free_api_index(reserved), replaces=old_index)

    def mark_ready(self, child):
        child.ready = True

    def drain(self, index):
        self.calls.append(("drain", index))
        child = self.api_servers.pop(index)
        child.stopping = True
        self.draining.append(child)
        return child

    def still_listens(self, child):
        return child.name in self.listening

    def kill(self, child, reason):
        self.calls.append(("kill", child.index, reason))
        child.kill_reason = child.kill_reason or reason

    def reap(self, child):
        self.calls.append(("reap", child.name))
        for group in (self.engines, self.draining):
            if child in group:
                group.remove(child)
        if self.api_servers.get(child.index) is child:
            del self.api_servers[child.index]

    def mark_engine_dead(self, rank):
        self.calls.append(("engine dead", rank))

    def silent_for(self, index, now):
        return now - self.last_beat[index]

    def dies(self, child, exitcode=SIGKILLED) -> ChildExited:
        child.process.exitcode = exitcode
        return ChildExited(child)


class Notifier:
    watchdog_interval = None

    def __init__(self):
        self.sent = []

    def __getattr__(self, name):
        return lambda *args: self.sent.append(name)


@pytest.fixture
def setup():
    def make(**config):
        clock = Clock()
        group = FakeGroup(ServeConfig(**{"api_server_count": 2, **config}), clock)
        timers = Timers(clock)
        notifier = Notifier()
        return Watchdog(group, timers, notifier), group, clock, timers, notifier
    return make


def fire_due_timers(watchdog: Watchdog, timers: Timers) -> list:
    return [o for key in timers.pop_due() if (o := watchdog.handle(TimerFired(key))) is not None]


def test_a_dead_api_server_is_restarted_at_once_then_with_back_off_until_the_budget_is_spent(setup):
    watchdog, group, clock, timers, _ = setup(max_restarts=3, restart_window=60)
    delays = []
    for _ in range(3):
        assert watchdog.handle(group.dies(group.api_servers[0])) is None
        assert group.calls[-1] == ("reap", "ApiServer_0") and 0 not in group.api_servers
        started = clock.now
        while not fire_due_timers(watchdog, timers) and ("spawn", 0, None) not in group.calls:
            clock.now += 0.125
        delays.append(clock.now - started)
        group.calls.clear()
    assert delays == [0.0, 0.25, 0.5]  # at once, then doubling
    assert watchdog.handle(group.dies(group.api_servers[0])) is Outcome.FAIL


def test_the_budget_forgets_restarts_older_than_the_window(setup):
    watchdog, group, clock, timers, _ = setup(max_restarts=1, restart_window=10)
    watchdog.handle(group.dies(group.api_servers[0]))
    fire_due_timers(watchdog, timers)
    clock.now += 11
    assert watchdog.handle(group.dies(group.api_servers[0])) is None


def test_an_engine_death_never_blocks_the_watchdog_and_fails_the_group_after_the_grace(setup):
    watchdog, group, clock, timers, _ = setup()
    started = time.monotonic()
    assert watchdog.handle(group.dies(group.engines[0])) is None
    assert time.monotonic() - started < 0.5  # no sleep: the grace is a timer
    assert ("engine dead", 0) in group.calls
    # During the grace the API servers answer 503; one that dies is not restarted.
    assert watchdog.handle(group.dies(group.api_servers[1])) is None
    clock.now += ENGINE_FAILURE_GRACE - 0.1
    assert fire_due_timers(watchdog, timers) == []
    assert not any(call[0] == "spawn" for call in group.calls)
    clock.now += 0.1
    assert fire_due_timers(watchdog, timers) == [Outcome.FAIL]


def test_a_stop_signal_during_the_engine_grace_fails_the_group_at_once(setup):
    watchdog, group, _, _, _ = setup()
    watchdog.handle(group.dies(group.engines[0]))
    assert watchdog.handle(SignalArrived(signal.SIGTERM)) is Outcome.FAIL


def test_an_engine_death_restarts_the_group_when_asked_to(setup):
    watchdog, group, _, _, _ = setup(on_engine_failure="restart")
    assert watchdog.handle(group.dies(group.engines[0])) is Outcome.RESTART_GROUP


def test_group_restarts_are_budgeted_across_the_groups_they_start(caplog):
    """Each group restarted in place gets a new watchdog; the count of restarts outlives them. Past the budget an
    engine's death takes the group down after the grace, as --on-engine-failure exit does."""
    caplog.set_level(logging.INFO, logger="supervisor.watchdog")
    clock = Clock()
    config = ServeConfig(on_engine_failure="restart", max_engine_restarts=2, engine_restart_window=600)
    group_restarts = RestartBudget(config.max_engine_restarts, config.engine_restart_window)

    def engine_dies_in_a_new_group():
        group, timers = FakeGroup(config, clock), Timers(clock)
        watchdog = Watchdog(group, timers, Notifier(), group_restarts)
        clock.now += 30  # the group loads, serves a while, then its engine dies
        return watchdog.handle(group.dies(group.engines[0])), watchdog, timers

    assert engine_dies_in_a_new_group()[0] is Outcome.RESTART_GROUP
    assert engine_dies_in_a_new_group()[0] is Outcome.RESTART_GROUP
    outcome, watchdog, timers = engine_dies_in_a_new_group()
    assert outcome is None and "2 group restart(s) within 600 s already" in caplog.text
    clock.now += ENGINE_FAILURE_GRACE
    assert fire_due_timers(watchdog, timers) == [Outcome.FAIL]
    clock.now += 600  # the window has passed: the next failure restarts again
    assert engine_dies_in_a_new_group()[0] is Outcome.RESTART_GROUP


def test_a_silent_server_is_killed_once_and_its_death_says_why(setup, caplog):
    watchdog, group, clock, timers, _ = setup(heartbeat_timeout=10)
    caplog.set_level(logging.INFO, logger="supervisor.watchdog")
    frozen = group.api_servers[1]
    for _ in range(40):  # the tick keeps coming while the killed server has not been reaped yet
        clock.now += 1.0
        group.last_beat[0] = clock.now
        fire_due_timers(watchdog, timers)
    kills = [call for call in group.calls if call[0] == "kill"]
    assert len(kills) == 1 and kills[0][1] == 1
    assert caplog.text.count("ApiServer_1 has not beaten for") == 1
    watchdog.handle(group.dies(frozen))
    assert "ApiServer_1 died: killed by SIGKILL (by the supervisor: its event loop was silent for" in caplog.text
    assert "perhaps out of memory" not in caplog.text


def test_a_draining_server_that_falls_silent_is_killed_too(setup, caplog):
    """Frozen mid-drain (a rolling restart's, SIGTTOU's), a server held its requests, its admission slots and its
    copy of the port until it was resumed: the heartbeat check looked at the serving servers only."""
    watchdog, group, clock, timers, _ = setup(heartbeat_timeout=10)
    caplog.set_level(logging.INFO, logger="supervisor.watchdog")
    watchdog.handle(SignalArrived(signal.SIGTTOU))
    (frozen,) = group.draining
    for _ in range(15):
        clock.now += 1.0
        group.last_beat[0] = clock.now
        fire_due_timers(watchdog, timers)
    assert [call for call in group.calls if call[0] == "kill"] == [
        ("kill", 1, "its event loop was silent for 11.0 s (--heartbeat-timeout)")]
    assert "ApiServer_1 has not beaten for 11.0 s, while it drained: killing it" in caplog.text
    watchdog.handle(group.dies(frozen))
    assert not any(call[0] == "spawn" for call in group.calls)  # its successor serves already


def test_a_server_killed_by_someone_else_may_have_run_out_of_memory(setup, caplog):
    watchdog, group, _, _, _ = setup()
    caplog.set_level(logging.INFO, logger="supervisor.watchdog")
    watchdog.handle(group.dies(group.api_servers[0]))
    assert "ApiServer_0 died: killed by SIGKILL (perhaps out of memory)" in caplog.text


def test_a_server_not_ready_in_time_is_killed_naming_the_option(setup):
    watchdog, group, clock, timers, _ = setup(api_server_ready_timeout=30)
    watchdog.handle(SignalArrived(signal.SIGTTIN))
    assert group.calls == [("spawn", 2, None)]
    for _ in range(35):
        clock.now += 1.0
        for i in (0, 1):
            group.last_beat[i] = clock.now
        fire_due_timers(watchdog, timers)
    kills = [call for call in group.calls if call[0] == "kill"]
    assert len(kills) == 1 and kills[0][1] == 2 and "--api-server-ready-timeout" in kills[0][2]


def test_sighup_replaces_each_server_once_its_successor_is_ready(setup):
    watchdog, group, _, _, notifier = setup()
    watchdog.handle(SignalArrived(signal.SIGHUP))
    assert group.calls == [("spawn", 2, 0)] and "reloading" in notifier.sent
    watchdog.handle(ChildReady(group.api_servers[2], True))
    assert group.calls[1:] == [("drain", 0), ("spawn", 3, 1)]  # index 0 is held while its server drains
    watchdog.handle(ChildReady(group.api_servers[3], True))
    assert group.calls[3:] == [("drain", 1)]
    assert notifier.sent[-1] == "ready" and sorted(group.api_servers) == [2, 3]
    watchdog.handle(group.dies(group.draining[0], exitcode=0))
    assert group.calls[-1] == ("reap", "ApiServer_0")
    assert not any(call[0] == "spawn" and call[1] == 0 for call in group.calls)  # a drained server stays gone


def test_a_sighup_during_a_rolling_restart_rolls_again_after_it(setup):
    """The second SIGHUP copied renewed TLS files: a server started before that read the old ones. It was dropped
    ("already under way"), and a third of the connections kept the old certificate."""
    watchdog, group, _, _, notifier = setup()
    watchdog.handle(SignalArrived(signal.SIGHUP))
    watchdog.handle(ChildReady(group.api_servers[2], True))
    watchdog.handle(SignalArrived(signal.SIGHUP))  # ApiServer_3 is starting: it may have read the old files
    watchdog.handle(ChildReady(group.api_servers[3], True))
    assert group.calls[-2:] == [("drain", 1), ("spawn", 4, 2)]  # the second roll begins with the first's servers
    assert notifier.sent.count("ready") == 1 and notifier.sent[-1] == "reloading"
    watchdog.handle(ChildReady(group.api_servers[4], True))
    watchdog.handle(ChildReady(group.api_servers[5], True))
    assert sorted(group.api_servers) == [4, 5] and notifier.sent[-1] == "ready" and not watchdog.rolling


def test_a_rolling_restart_ends_only_once_the_drained_servers_stopped_listening(setup, caplog):
    """READY=1 (what `systemctl reload` waits for) and "rolling restart done" come once no old server can accept a
    connection; one that never stops listening ends the wait after ROLL_END_LIMIT, with a warning."""
    watchdog, group, clock, timers, notifier = setup(api_server_count=1)
    group.listening.add("ApiServer_0")
    watchdog.handle(SignalArrived(signal.SIGHUP))
    watchdog.handle(ChildReady(group.api_servers[1], True))
    assert ("drain", 0) in group.calls and watchdog.rolling and notifier.sent[-1] != "ready"
    clock.now += ROLL_END_POLL
    fire_due_timers(watchdog, timers)
    assert watchdog.rolling  # still listening
    group.listening.clear()
    clock.now += ROLL_END_POLL
    fire_due_timers(watchdog, timers)
    assert not watchdog.rolling and notifier.sent[-1] == "ready"

    group.listening.add("ApiServer_1")  # stuck: its loop never gets to the SIGTERM
    with caplog.at_level(logging.WARNING, logger="supervisor.watchdog"):
        watchdog.handle(SignalArrived(signal.SIGHUP))
        watchdog.handle(ChildReady(group.api_servers[2], True))  # index 0 is held while its server drains
        while watchdog.rolling:
            assert clock.now < 1000.0 + 2 * ROLL_END_LIMIT
            clock.now += ROLL_END_POLL
            fire_due_timers(watchdog, timers)
    assert notifier.sent[-1] == "ready" and "ApiServer_1 still listen" in caplog.text


def test_a_replacement_that_dies_is_restarted_as_a_replacement(setup):
    watchdog, group, _, timers, notifier = setup()
    watchdog.handle(SignalArrived(signal.SIGHUP))
    watchdog.handle(group.dies(group.api_servers[2]))
    fire_due_timers(watchdog, timers)
    assert group.calls[-1] == ("spawn", 2, 0)
    watchdog.handle(ChildReady(group.api_servers[2], True))
    assert ("drain", 0) in group.calls and group.calls[-1] == ("spawn", 3, 1)  # the rolling restart goes on


def test_sigttin_leaves_the_index_of_a_server_waiting_for_its_restart(setup):
    watchdog, group, _, timers, _ = setup(max_restarts=5)
    watchdog.handle(group.dies(group.api_servers[0]))
    fire_due_timers(watchdog, timers)
    watchdog.handle(group.dies(group.api_servers[0]))  # the second death waits for its back-off
    watchdog.handle(SignalArrived(signal.SIGTTIN))
    assert group.calls[-1] == ("spawn", 2, None)


def test_sigttou_drains_the_highest_index_and_keeps_the_last_server(setup):
    watchdog, group, _, _, _ = setup()
    watchdog.handle(SignalArrived(signal.SIGTTOU))
    watchdog.handle(SignalArrived(signal.SIGTTOU))
    assert [call for call in group.calls if call[0] == "drain"] == [("drain", 1)]
    assert list(group.api_servers) == [0]


def test_sigterm_stops_gracefully(setup):
    watchdog, _, _, _, _ = setup()
    assert watchdog.handle(SignalArrived(signal.SIGINT)) is Outcome.STOP
