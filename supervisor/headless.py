"""`supervise --headless`: a node that runs engine cores only, registered with the head.

No API servers and no HTTP port: the node starts its ranks' engines on TCP (CURVE with the deployment's key),
waits for them to load (READY to systemd then, like a head), and from then on says HELLO to the head four
times per --engine-ping-interval (ipc/registration.py). The same beat registers the node, keeps it registered,
and registers it again with a head that restarted: the engines stay loaded meanwhile, however long the head is
away, and the node logs that it waits (and why, where its handshake tells: a key on one side only; it then
connects again every few seconds, which ZMQ does not). When a new head appears, the old head's API servers are
all gone, so their unfinished requests are aborted on this node's engines.

The node goes down, saying LEAVING first so that the head marks its ranks down at once:
- on SIGTERM/SIGINT (exit 0), once its ranks have finished their running requests, which the head sends no new
  ones meanwhile (supervisor/node_drain.py; up to --shutdown-timeout, a second signal cuts it short), its
  engines stopped cleanly;
- when one of its engines dies (exit 1): the node cannot serve its ranks, and its service manager restarts it;
- when the head refuses it (exit 2): wrong size, a rank out of range or taken, another model; one line says why.
"""
from __future__ import annotations

import logging
import shutil
import socket
import sys
import tempfile
import time
import uuid

import zmq
from setproctitle import setproctitle
from zmq.utils.monitor import recv_monitor_message

from ipc.config import ServeConfig
from ipc.curve import CurveKeys, KeyProblem, load_keys, warn_if_unauthenticated
from ipc.logs import setup_logging
from ipc.model_info import ModelInfo
from ipc.registration import (HelloAccepted, HelloRefused, MalformedMessage, NodeDraining, NodeHello, NodeLeaving,
                              decode_node_message, encode_node_message)
from ipc.sockets import NODE_SUPERVISOR_IDENTITY, dealer, tcp_address
from supervisor.engine_liveness import EngineLiveness
from supervisor.events import ChildExited, EventSource, LinkEvent, SignalArrived, TimerFired, Timers
from supervisor.group import ProcessGroup
from supervisor.layout import Layout, engine_host_toward, layout_of
from supervisor.node_drain import DRAIN_POLL, NodeDrain
from supervisor.open_files import raise_open_files_limit
from supervisor.signals import STOP_SIGNALS, SignalInbox, describe_exit
from supervisor.startup import StartupFailed, StopRequested
from supervisor.systemd import SystemdNotifier

log = logging.getLogger("supervisor")

BEATS_PER_INTERVAL = 4
WAITING_LOG_EVERY = 15.0  # seconds between "the head does not answer" lines, the first as the head falls silent
# Seconds before connecting again after a handshake with the head failed: ZMQ itself never tries again after one
# the head refused for its security mechanism (nor, now and then, after one that broke off), and the head may yet
# be restarted with this node's setting.
CONNECT_AGAIN_AFTER = 5.0
_MECHANISM_MISMATCH = 0x11000002  # ZMQ's protocol error code (a handshake failure's value) for it
_BEAT = "beat"
OWN_PAUSE_BEATS = 4  # a beat this many beats late: the supervisor itself did not run meanwhile
_DRAIN_POLL = "drain-poll"


class HeadLink:
    """The node's DEALER to the head's registration port."""

    def __init__(self, config: ServeConfig, layout: Layout, curve: CurveKeys | None, engines: dict[int, str],
                 model: ModelInfo):
        self.node_id = uuid.uuid4().hex
        self.head = tcp_address(config.data_parallel_address, config.data_parallel_rpc_port)
        self._zmq = zmq.Context(io_threads=1)
        # Nothing queued while the head is away: a beat is worth sending now or never.
        self._sock = dealer(self._zmq, self.head, self.node_id.encode(), curve, immediate=True)
        # Watched from the first handshake on: one the head refuses for its mechanism is the only way this node
        # learns why the head never answers.
        self._handshakes = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                                         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                                         zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sock.connect(self.head)
        self._keyed = curve is not None
        self.refusal: str | None = None  # why the head's handshake refuses this node, where the node can tell
        self._connect_again_at: float | None = None  # after a failed handshake
        self.head_id = ""  # the head that last accepted this node
        self.last_answer = time.monotonic()
        self._hello = NodeHello(
            node_id=self.node_id, node_name=socket.gethostname(), data_parallel_size=layout.size,
            ranks=list(layout.local_ranks), addresses=[engines[r] for r in layout.local_ranks],
            model_name=config.model_name, vocab_size=model.vocab_size, max_model_len=model.max_model_len, head_id="",
        )

    def filenos(self) -> list[int]:
        return [self._sock.fileno(), self._handshakes.fileno()]

    def seconds_to_next(self) -> None:
        return None

    def hello(self) -> None:
        if self._connect_again_at is not None and time.monotonic() > self._connect_again_at:
            self._connect_again_at = None
            self._sock.disconnect(self.head)  # no connection to lose: its handshake failed
            self._sock.connect(self.head)
        self._hello.head_id = self.head_id
        self._send(self._hello)

    def drain(self, reason: str) -> None:
        self._send(NodeDraining(self.node_id, reason))

    def leave(self, reason: str) -> None:
        self._send(NodeLeaving(self.node_id, reason))

    def take(self) -> list[LinkEvent]:
        self._take_handshakes()
        events: list[LinkEvent] = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            try:
                answer = decode_node_message(frames)
            except MalformedMessage as exc:
                log.warning("ignoring a malformed answer from the head: %s", exc)
                continue
            self.last_answer = time.monotonic()
            if isinstance(answer, HelloAccepted):
                events.append(LinkEvent("accepted", answer.head_id))
            elif isinstance(answer, HelloRefused):
                events.append(LinkEvent("refused", answer.reason))

    def _take_handshakes(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._handshakes, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # ZMQ's own try again worked: nothing to do
                self._connect_again_at = self.refusal = None
                continue
            self._connect_again_at = time.monotonic() + CONNECT_AGAIN_AFTER
            if event["value"] == _MECHANISM_MISMATCH:
                self.refusal = ("this node has a --data-parallel-key-file and the head none" if self._keyed else
                                "the head has a --data-parallel-key-file and this node none")

    def _send(self, record) -> None:
        try:
            self._sock.send_multipart(encode_node_message(record), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected to a head now: the next beat tries again
        # The send may take the FD's edge of an answer that came meanwhile: the event source drains on every
        # wake, and a beat wakes it four times per interval, so an answer waits at most one beat.

    def close(self) -> None:
        self._handshakes.close(linger=0)
        self._sock.close(linger=500)  # a LEAVING just sent still goes out
        self._zmq.term()


def serve_headless(config: ServeConfig) -> int:
    setproctitle("supervise: supervisor (headless)")
    setup_logging("supervisor", config.log_level)
    raise_open_files_limit()  # before any child: they inherit it
    layout = layout_of(config)
    try:
        curve = load_keys(config.data_parallel_key_file)
        engine_host = config.data_parallel_engine_host or engine_host_toward(
            config.data_parallel_address, config.data_parallel_rpc_port)
    except KeyProblem as exc:
        print(f"supervise: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"supervise: error: no route to the head at {config.data_parallel_address}: {exc.strerror}",
              file=sys.stderr)
        return 2
    notifier = SystemdNotifier()
    warn_if_unauthenticated(curve, f"engine ports on {engine_host}")
    inbox = SignalInbox()
    runtime_dir = tempfile.mkdtemp(prefix="supervise-")
    config = config.replace(runtime_dir=runtime_dir)
    events = EventSource(inbox, Timers())
    group = ProcessGroup(config, None, events, notifier, curve=curve, engine_host=engine_host)
    link = None
    try:
        try:
            group.start_engines(link_identity=NODE_SUPERVISOR_IDENTITY)
        except StartupFailed as exc:
            print(f"supervise: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except StopRequested:
            log.info("stop requested while starting")
            return 0
        assert group.model is not None  # set by start_engines
        link = HeadLink(config, layout, curve, group.engine_addresses, group.model)
        events.links.append(link)
        summary = (f"headless node: {layout.describe()} loaded at "
                   f"{', '.join(group.engine_addresses[r] for r in layout.local_ranks)}; registering with {link.head}")
        log.info("%s", summary)
        notifier.ready(summary)
        return _run(config, group, link, events, notifier)
    finally:
        notifier.stopping()
        group.kill_all()
        group.close()
        if link is not None:
            link.close()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run(config: ServeConfig, group: ProcessGroup, link: HeadLink, events: EventSource,
         notifier: SystemdNotifier) -> int:
    beat = config.engine_ping_interval / BEATS_PER_INTERVAL
    timers = events.timers
    timers.set(_BEAT, 0)
    last_beat = time.monotonic()
    last_waiting_line = -WAITING_LOG_EVERY  # the first line as soon as the head is silent
    drain: NodeDrain | None = None  # told to stop: the ranks finish their requests first
    liveness = EngineLiveness(config.engine_ping_interval)
    while True:
        for event in events.wait(group.engines):
            if isinstance(event, ChildExited):
                child = event.child
                how = describe_exit(child.exitcode, child.kill_reason)
                log.error("%s died (%s): this node cannot serve its ranks, going down", child.name, how)
                link.leave(f"{child.name} died ({how})")
                group.reap(child)
                group.stop(drain_timeout=0)
                return 1
            if isinstance(event, SignalArrived) and event.signum in STOP_SIGNALS:
                if not link.head_id:  # never registered: no head sent its engines a request
                    log.info("stopping before any head registered this node")
                    return _leave(group, link, "stopped")
                if drain is None:
                    drain = _start_drain(config, group, link, notifier, time.monotonic() - link.last_answer > 2 * beat)
                    timers.set(_DRAIN_POLL, 0)
                    continue
                assert group.engine_link is not None  # the engines serve
                log.warning("a second stop signal: leaving now with %d request(s) unfinished",
                            drain.unfinished(group.engine_link.stats))
                return _leave(group, link, "stopped (a second signal cut the drain short)")
            if isinstance(event, TimerFired) and event.key == _DRAIN_POLL and drain is not None:
                left = _drain_step(config, group, link, drain)
                if left is not None:
                    return left
                timers.set(_DRAIN_POLL, DRAIN_POLL)
            if isinstance(event, LinkEvent) and event.what == "refused":
                log.error("the head at %s refused this node: %s", link.head, event.detail)
                print(f"supervise: error: the head at {link.head} refused this node: {event.detail}", file=sys.stderr)
                group.stop(drain_timeout=0)
                return 2
            if isinstance(event, LinkEvent) and event.what == "accepted":
                last_waiting_line = -WAITING_LOG_EVERY  # the next silence is told at once
                if drain is not None:
                    drain.head_answered()
                elif event.detail != link.head_id:
                    _on_new_head(group, link, event.detail, notifier)
            if isinstance(event, TimerFired) and event.key == _BEAT:
                last_beat = _own_pause(link, last_beat, beat)
                if drain is None:
                    link.hello()
                else:
                    link.drain("stopped")
                timers.set(_BEAT, beat)
                notifier.watchdog_if_due()  # under systemd with WatchdogSec=: this loop is alive
                liveness.kill_silent(group.engine_link, group.engines)
                now = time.monotonic()
                silent = now - link.last_answer
                if silent > config.engine_ping_interval and now - last_waiting_line > WAITING_LOG_EVERY and not drain:
                    last_waiting_line = now
                    why = (f"its handshake refuses this node: {link.refusal}" if link.refusal else
                           "a head that is up yet never answers refuses this node's --data-parallel-key-file: its "
                           "log says 'refused a connection'")
                    log.warning("no answer from the head at %s for %.0f s: the engines stay loaded, waiting for it "
                                "(%s)", link.head, silent, why)
                    notifier.status("waiting for the head")


def _own_pause(link: HeadLink, last_beat: float, beat: float) -> float:
    """This supervisor did not run for a while (SIGSTOP, a suspended VM, a starved CPU): no beat went out, so no
    answer came, and that silence is its own, not the head's. Told as such, and left out of the head's silence
    (a draining node took it for a head gone and left with its requests unfinished). The beat's time, now."""
    now = time.monotonic()
    gap = now - last_beat
    if gap > OWN_PAUSE_BEATS * beat:
        log.warning("this node's supervisor did not run for %.1f s (stopped, or starved of CPU): no heartbeat went to "
                    "the head meanwhile, which may have taken its ranks for lost; they register again now", gap)
        link.last_answer = min(now, link.last_answer + gap - beat)
    return now


def _start_drain(config: ServeConfig, group: ProcessGroup, link: HeadLink, notifier: SystemdNotifier,
                 head_silent: bool) -> NodeDrain:
    log.info("stopping: the head sends no new requests to rank(s) %s; waiting up to %g s (--shutdown-timeout) for "
             "the running ones", ", ".join(map(str, group.layout.local_ranks)), config.shutdown_timeout)
    notifier.status("draining")
    link.drain("stopped")
    return NodeDrain(group.layout.local_ranks, config.shutdown_timeout, head_silent)


def _drain_step(config: ServeConfig, group: ProcessGroup, link: HeadLink, drain: NodeDrain) -> int | None:
    """Leave (the exit code) once the engines hold nothing or the time is up; else ask them again (None)."""
    assert group.engine_link is not None  # the engines serve
    stats = group.engine_link.stats
    if drain.drained(stats):
        log.info("the engines run nothing more")
        return _leave(group, link, "stopped")
    silent = time.monotonic() - link.last_answer
    if silent > config.engine_ping_interval:
        # Gone (its requests have no reader), or cut off; a head frozen with its API servers alive still sends
        # work here, as it never heard of the drain: waiting on would only cut more requests later.
        log.warning("the head at %s has not answered for %.0f s: leaving with %d request(s) unfinished", link.head,
                    silent, drain.unfinished(stats))
        return _leave(group, link, "stopped (the head did not answer)")
    if drain.timed_out():
        log.warning("--shutdown-timeout (%g s) passed with %d request(s) unfinished: leaving anyway",
                    config.shutdown_timeout, drain.unfinished(stats))
        return _leave(group, link, "stopped (--shutdown-timeout passed)")
    for rank in group.layout.local_ranks:
        group.engine_link.ask_stats(rank)
    return None


def _leave(group: ProcessGroup, link: HeadLink, reason: str) -> int:
    link.leave(reason)
    graceful = group.stop(drain_timeout=0)
    log.info("stopped%s", "" if graceful else " (cut short by a second signal)")
    return 0


def _on_new_head(group: ProcessGroup, link: HeadLink, head_id: str, notifier: SystemdNotifier) -> None:
    if link.head_id:
        log.info("registered with a new head at %s: aborting the old head's unfinished requests", link.head)
        assert group.engine_link is not None  # registering needs the engines serving
        group.engine_link.abort_every_client()
    else:
        log.info("registered with the head at %s", link.head)
    link.head_id = head_id
    notifier.status(f"registered with the head at {link.head}")
