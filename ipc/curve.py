"""Authenticated engine ports: ZMQ CURVE with one key shared by every node of a deployment.

An engine port on TCP would take work from anyone who can reach it, and the head's registration port would
let anyone pose as an engine and be sent prompts. With a key, every such socket is a CURVE server and every
peer a CURVE client: the traffic is encrypted, and a ZAP handler admits only clients that prove they hold the
shared key (the client's permanent key pair is the shared one too), so a client without it never gets a
message through, malformed or not.

The key is any secret of 32 characters or more, from `--data-parallel-key-file` or the environment variable
SUPERVISE_DATA_PARALLEL_KEY; `openssl rand -hex 32 > dp.key` makes one. Its SHA-256 is the CURVE secret key
(Curve25519 takes any 32 bytes), so nothing but the file has to be copied to each node.

The ZAP handler is a thread with a REP socket on the context's inproc://zeromq.zap.01. It ends by itself when
its context is terminated (its recv raises ETERM and it closes its socket), so code that owns a context needs
nothing more than its usual `ctx.term()`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

KEY_ENV = "SUPERVISE_DATA_PARALLEL_KEY"
MIN_KEY_CHARS = 32
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class KeyProblem(ValueError):
    """The key cannot be used (one line for the operator)."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # Z85, 40 characters
    secret: bytes

    @classmethod
    def from_secret_text(cls, text: str) -> "CurveKeys":
        text = text.strip()
        if len(text) < MIN_KEY_CHARS:
            raise KeyProblem(f"the data-parallel key has {len(text)} characters, at least {MIN_KEY_CHARS} are needed "
                            f"(make one with: openssl rand -hex 32)")
        secret = z85.encode(hashlib.sha256(text.encode()).digest())
        return cls(zmq.curve_public(secret), secret)

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public.decode()})"


def load_keys(key_file: str | None) -> CurveKeys | None:
    """The shared key from `key_file`, else from $SUPERVISE_DATA_PARALLEL_KEY; None when neither is set."""
    if key_file:
        try:
            with open(key_file) as f:
                text = f.read()
            mode = os.stat(key_file).st_mode
        except OSError as exc:
            raise KeyProblem(f"cannot read --data-parallel-key-file {key_file}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s can be read by other users: chmod 600 it", key_file)
        return CurveKeys.from_secret_text(text)
    env_text = os.environ.get(KEY_ENV)
    if env_text:
        return CurveKeys.from_secret_text(env_text)
    return None


def warn_if_unauthenticated(keys: CurveKeys | None, what: str) -> None:
    """Once at start-up: a TCP port of the deployment without a key takes work from anyone who reaches it."""
    if keys is None:
        log.warning("unauthenticated %s (no --data-parallel-key-file or %s): anyone who can reach it can use "
                    "it; it listens only on the address given", what, KEY_ENV)


def secure_server(ctx: zmq.Context[zmq.Socket[Any]], sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make `sock` (before it binds) a CURVE server that admits only holders of `keys`."""
    start_zap_handler(ctx, keys)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"supervise")


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of a server that holds `keys`, proving it holds them too."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


_handlers: dict[int, threading.Thread] = {}  # id(context) -> its ZAP thread
_handlers_lock = threading.Lock()


def start_zap_handler(ctx: zmq.Context[zmq.Socket[Any]], keys: CurveKeys) -> None:
    """Once per context: the thread that answers libzmq's authentication requests."""
    with _handlers_lock:
        thread = _handlers.get(id(ctx))
        if thread is not None and thread.is_alive():
            return
        zap = ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(_ZAP_ENDPOINT)  # bound here, before any server socket binds: no request can come unanswered
        thread = threading.Thread(target=_answer_zap, args=(zap, z85.decode(keys.public)), name="zap", daemon=True)
        thread.start()
        _handlers[id(ctx)] = thread


# A peer refused again is logged again after this many seconds: not a line per reconnect attempt (ZMQ retries
# every few hundred milliseconds), yet a node misconfigured today is not hidden by a probe from the same address
# last week.
REFUSED_LOG_EVERY_S = 60.0


def _answer_zap(zap: zmq.Socket[Any], allowed_key: bytes) -> None:
    refused_at: dict[str, float] = {}  # peer address -> when its last refusal was logged
    try:
        while True:
            frames = zap.recv_multipart()
            ok, address = _verdict(frames, allowed_key)
            now = time.monotonic()
            if not ok and now - refused_at.get(address, -REFUSED_LOG_EVERY_S) >= REFUSED_LOG_EVERY_S:
                if len(refused_at) > 10_000:  # many addresses (a scan): forget the old ones
                    refused_at.clear()
                refused_at[address] = now
                log.warning("refused a connection from %s: it does not hold the data-parallel key", address)
            request_id = frames[1] if len(frames) > 1 else b""
            zap.send_multipart([b"1.0", request_id,
                                b"200" if ok else b"400", b"OK" if ok else b"not the deployment's key", b"", b""])
    except zmq.ZMQError:  # ETERM: the context is going away
        pass
    finally:
        zap.close(linger=0)


def _verdict(frames: list[bytes], allowed_key: bytes) -> tuple[bool, str]:
    """ZAP request: version, request id, domain, address, identity, mechanism, credentials..."""
    if len(frames) < 7:
        return False, "?"
    address = frames[3].decode(errors="replace")
    return frames[0] == b"1.0" and frames[5] == b"CURVE" and frames[6] == allowed_key, address
