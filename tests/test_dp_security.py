"""The engine and registration ports on TCP admit only holders of the deployment's key (ZMQ CURVE): a client
without it gets nothing through, well-formed or not, and the engine serves on. Without a key, the ports listen
only where they were told to, and the operator is warned once."""
import os
import socket
import subprocess
import time
import uuid

import httpx
import psutil
import zmq
from zmq.utils import z85

from ipc.codec import decode, encode
from ipc.curve import CurveKeys, load_keys
from ipc.messages import EngineRequest, UtilityCall
from ipc.registration import NodeHello, encode_node_message
from ipc.sampling import SamplingParams
from tests.dp_support import SIM_MODEL, complete, deployment, dp_args, free_port, key_file, wait_for  # noqa: F401
from tests.supervise_process import SUPERVISE


def _hostile_frames() -> list[list[bytes]]:
    add = encode(EngineRequest("stolen", [1, 2, 3], SamplingParams(max_tokens=5)))
    return [add, encode(UtilityCall(1, "ping")), encode(UtilityCall(2, "abort_client", ["api-0"])),
            [b"A", b"{not json"], [b"\xff"] * 7, [b""], [os.urandom(2000)]]


def _answers(address: str, configure) -> list:
    """Every message a DEALER set up by `configure` gets back within 2 s for the hostile frames."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket a failed test leaves open never blocks term() in GC
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"api-0")  # even posing as a real API server's identity
    configure(sock)
    sock.connect(address)
    for frames in _hostile_frames():
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass
    answers = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        if sock.poll(100):
            answers.append(sock.recv_multipart())
    sock.close(0)
    ctx.term()
    return answers


def test_a_client_without_the_key_cannot_submit_or_crash_an_engine(deployment, key_file):
    rpc = free_port()
    key = ["--data-parallel-key-file", key_file]
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", *key), wait=False,
                           env={"SUPERVISE_DEV_MODE": "1"})
    node = deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1", *key))
    head.wait_serving()
    address = httpx.get(f"{head.url}/load", timeout=10).json()["engines"][1]["address"]
    engine_pid = node.engine_pids()[1]
    keys = load_keys(key_file)

    # No CURVE at all; CURVE knowing the engine's public key (as if it leaked) but with a key pair of its own.
    assert _answers(address, lambda sock: None) == []
    own_public, own_secret = zmq.curve_keypair()

    def other_key(sock):
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.public, own_public, own_secret

    assert _answers(address, other_key) == []
    # Raw bytes at the TCP port: a ZMTP greeting gone wrong, then noise.
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00CURVE" + os.urandom(4096))
        time.sleep(0.2)
    # Nor can such a client register a rank with the head.
    hello = NodeHello(uuid.uuid4().hex, "intruder", 2, [1], ["tcp://127.0.0.1:9"], SIM_MODEL, 49152, 8192, "")
    assert _answers(f"tcp://127.0.0.1:{rpc}", lambda sock: None) == []
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket a failed test leaves open never blocks term() in GC
    sock = ctx.socket(zmq.DEALER)
    other_key(sock)
    sock.connect(f"tcp://127.0.0.1:{rpc}")
    sock.send_multipart(encode_node_message(hello))
    assert not sock.poll(2000)
    sock.close(0)
    ctx.term()

    # The engine lives on, took nothing from them, and serves the head as before.
    assert psutil.Process(engine_pid).is_running() and node.engine_pids() == {1: engine_pid}
    assert complete(head.url, {"X-data-parallel-rank": "1"}).status_code == 200
    stats = httpx.get(f"{head.url}/server_info", timeout=10).json()["engines"][1]
    assert (stats["num_finished"], stats["num_requests"]) == (1, 0), stats  # the pinned one alone: "stolen" never came
    assert "refused a connection from" in node.log() and "does not hold the data-parallel key" in node.log()
    assert "intruder" not in head.log()


def test_a_keyholder_s_malformed_frames_are_dropped_and_the_engine_serves_on(deployment, key_file):
    rpc = free_port()
    key = ["--data-parallel-key-file", key_file]
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", *key), wait=False)
    node = deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1", *key))
    head.wait_serving()
    address = httpx.get(f"{head.url}/load", timeout=10).json()["engines"][1]["address"]
    keys: CurveKeys = load_keys(key_file)

    def holder(sock):
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.public, keys.public, keys.secret

    # Frames of no record, then records whose fields have the wrong types: each dropped when it is decoded.
    frames = [[b"A", b"{not json"], [b"\xff"] * 7, [b"Q", b"{}"], [b"U", b"[1, 2]"],
              [b"X", b'{"request_ids": 5}'], [b"X", b'{"request_ids": ["a"], "indices": ["b"]}'],
              [b"A", b'{"request_id": 5, "prompt_token_ids": [1], "sampling": {}}'],
              [b"A", b'{"request_id": "x", "prompt_token_ids": ["a"], "sampling": {"n": 2}}'],
              [b"A", b'{"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": "many"}}'],
              [b"U", b'{"call_id": "1", "method": "ping"}']]
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a socket a failed test leaves open never blocks term() in GC
    sock = ctx.socket(zmq.DEALER)
    holder(sock)
    sock.connect(address)
    for f in frames:
        sock.send_multipart(f)
    sock.send_multipart(encode(UtilityCall(7, "ping")))  # answered: the connection itself works
    # The ADDs whose id could be read are answered with an error output per choice, so no sender waits for them
    # (by the step thread: the pong, from the engine's I/O thread, may come before or after them).
    pongs, errors = 0, []
    while pongs < 1 or len(errors) < 3:
        assert sock.poll(5000), (pongs, errors)
        reply = sock.recv_multipart()
        if reply[0] == b"R":
            pongs += 1
        else:
            errors += decode(reply).outputs
    assert [(out.request_id, out.finish_reason) for out in errors] == [("x", "error")] * 3, errors  # n=2, then 1
    assert not sock.poll(500)  # and nothing more
    sock.close(0)
    ctx.term()
    assert node.log().count("malformed message") == len(frames)
    assert complete(head.url, {"X-data-parallel-rank": "1"}).status_code == 200


def test_keys_that_cannot_be_used_are_refused_in_one_line(tmp_path):
    short = tmp_path / "short.key"
    short.write_text("too short")
    short.chmod(0o600)
    for args, env, line in [
        (["--data-parallel-key-file", str(tmp_path / "missing.key")], {},
         f"cannot read --data-parallel-key-file {tmp_path / 'missing.key'}: No such file or directory"),
        (["--data-parallel-key-file", str(short)], {}, "the data-parallel key has 9 characters, at least 32"),
        ([], {"SUPERVISE_DATA_PARALLEL_KEY": "x" * 31}, "the data-parallel key has 31 characters"),
    ]:
        for mode in ([], ["--headless", "--data-parallel-size", "2", "--data-parallel-start-rank", "1"]):
            result = subprocess.run([SUPERVISE, "--model", "sim:1", "--port", "0", *mode, *args], timeout=60,
                                    capture_output=True, text=True, env={**os.environ, **env})
            assert result.returncode == 2 and line in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_key_file_others_can_read_is_warned_about(tmp_path):
    path = tmp_path / "open.key"
    path.write_text("k" * 40)
    path.chmod(0o644)
    result = subprocess.run([SUPERVISE, "--model", "sim:1", "--data-parallel-key-file", str(path), "--port", "0",
                             "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                             "--engine-ready-timeout", "1"], timeout=60, capture_output=True, text=True)
    assert f"{path} can be read by other users: chmod 600 it" in result.stderr


def test_a_key_is_derived_the_same_on_every_node(key_file):
    text = open(key_file).read()
    assert CurveKeys.from_secret_text(text) == CurveKeys.from_secret_text(text.strip() + "\n\n")
    assert z85.decode(CurveKeys.from_secret_text(text).public) != z85.decode(CurveKeys.from_secret_text(text + "x").public)
    keys = load_keys(key_file)
    assert keys.secret.decode() not in repr(keys) and text.strip() not in repr(keys)


def test_a_peer_refused_again_is_logged_again_after_a_while(monkeypatch, caplog):
    """The refusal log: not a line per reconnect attempt, yet a node misconfigured now is not hidden by an earlier
    refusal from the same address (a probe, the same node before a fix): again after REFUSED_LOG_EVERY_S."""
    from ipc import curve

    now = [0.0]
    monkeypatch.setattr(curve.time, "monotonic", lambda: now[0])
    attempts = [(0.0, "10.0.0.5"), (0.3, "10.0.0.5"), (30.0, "10.0.0.5"), (30.1, "10.0.0.6"),
                (curve.REFUSED_LOG_EVERY_S + 1, "10.0.0.5")]

    class Zap:
        """The ZAP socket: one refused request per attempt, then the context's end."""

        def __init__(self):
            self.answers = []

        def recv_multipart(self):
            if not attempts:
                raise zmq.ZMQError(zmq.ETERM)
            now[0], address = attempts.pop(0)
            return [b"1.0", b"id", b"", address.encode(), b"", b"CURVE", b"a key nobody holds"]

        def send_multipart(self, frames):
            self.answers.append(frames[2])

        def close(self, linger=0):
            pass

    zap = Zap()
    with caplog.at_level("WARNING", logger="ipc.curve"):
        curve._answer_zap(zap, b"the deployment's key")
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert zap.answers == [b"400"] * 5
    assert [m.split()[4] for m in refused] == ["10.0.0.5:", "10.0.0.6:", "10.0.0.5:"]


def test_a_node_with_another_key_or_none_is_named_in_the_head_s_log(deployment, key_file, tmp_path):
    """Such a node never reaches the ZAP handler that logs a refused key: with another key the head cannot open its
    first message, with none the two sides' mechanisms differ, and ZMQ dropped the connection without a word
    while the node said "its log says 'refused a connection'". Now the head's log says it, once a minute."""
    rpc = free_port()
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", "--data-parallel-key-file",
                                    key_file), wait=False)
    other = tmp_path / "other.key"
    other.write_text(os.urandom(32).hex() + "\n")
    other.chmod(0o600)
    for key, words in ((["--data-parallel-key-file", str(other)], "it does not hold the data-parallel key"),
                       ([], "a node without --data-parallel-key-file, where this head has one")):
        # (A node whose first handshake breaks off before ZMQ can tell why, once in five runs here, tries again
        # after 5 s, which ZMQ itself does not.)
        node = deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1", *key), wait=False)
        wait_for(lambda: f"refused a connection to the registration port: {words}" in head.log(), 15,
                 "the head to name the node", head)
        node.stop()
    lines = [line for line in head.log().splitlines() if "refused a connection to the registration port" in line]
    assert len(lines) == 2, lines  # one each, not one per retry
    assert "registered" not in head.log()


def test_a_node_without_the_head_s_key_says_why_and_registers_once_the_head_matches_it(deployment, key_file):
    """The head's handshake refuses a node without a key, where it has one (their mechanisms differ): the node's
    log says so, not only the head's. ZMQ never connects again after such a refusal, so the node stayed
    unregistered for good; it connects again every few seconds, and registers with a head restarted without the
    key (or with a node restarted with it)."""
    rpc = free_port()
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1", "--data-parallel-key-file",
                                    key_file), wait=False)
    node = deployment.node(*dp_args(2, rpc, "--data-parallel-start-rank", "1"), wait=False)
    wait_for(lambda: "its handshake refuses this node: the head has a --data-parallel-key-file and this node none"
             in node.log(), 20, "the node to say why the head does not answer", node)
    head.stop()
    head = deployment.head(*dp_args(2, rpc, "--data-parallel-size-local", "1"))
    node.wait_registered(30)
    assert complete(head.url, {"X-data-parallel-rank": "1"}).status_code == 200
