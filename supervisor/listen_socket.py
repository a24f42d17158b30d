"""The group's one listening socket: bound before anything slow happens, shared by every API server.

Binding first means a busy port fails in a second, not after the model loaded; and since the supervisor
holds the socket for the group's whole life, restarting API servers never closes the port: clients wait
in the backlog instead of being refused.
"""
from __future__ import annotations

import errno
import os
import socket

SD_LISTEN_FDS_START = 3


class PortInUse(Exception):
    pass


class BadAddress(Exception):
    """--host is no address this machine can listen on: not an address or a name that resolves, or not one of
    its own (a bad option, one line and exit 2, where a busy port is a state of the machine)."""


class BadSocketActivation(Exception):
    """LISTEN_PID names this process, but LISTEN_FDS is no count or its first descriptor no socket."""


def open_listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """The socket systemd passed us (socket activation), else a fresh one bound to host:port."""
    inherited = _systemd_socket()
    if inherited is not None:
        return inherited
    sock = bind_shared_port(host, port)
    sock.listen(backlog)
    return sock


def bind_shared_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that the group's servers may share (SO_REUSEPORT), not listening yet.
    Raises PortInUse when another process holds the port, BadAddress when `host` is none of this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        _refuse_if_taken(family, host, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    except socket.gaierror as exc:
        raise BadAddress(f"--host {host}: not an IP address, nor a host name that resolves ({exc.strerror})") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise BadAddress(f"--host {host}: not an address of this machine ({exc.strerror})") from None
        raise
    sock.set_inheritable(True)
    return sock


def _refuse_if_taken(family: int, host: str, port: int) -> None:
    """A plain SO_REUSEPORT bind would silently share the port with a stranger (same user), so probe first
    with a socket that does not ask to share: it fails if anyone else is bound there."""
    if port == 0:
        return
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not owners
        probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port} is already in use by another process") from None
        raise
    finally:
        probe.close()


def _systemd_socket() -> socket.socket | None:
    """Adopt the first socket of systemd socket activation (LISTEN_FDS / LISTEN_PID), if meant for us."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    value = os.environ.get("LISTEN_FDS", "0") or "0"
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # children must not adopt it a second time
    if not value.isdigit():
        raise BadSocketActivation(f"LISTEN_FDS={value!r} is not a count of descriptors (systemd socket activation)")
    if int(value) < 1:
        return None
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as exc:
        raise BadSocketActivation(f"LISTEN_FDS={value}, but descriptor {SD_LISTEN_FDS_START} is not a socket: "
                                  f"{exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def bound_address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return host, port
