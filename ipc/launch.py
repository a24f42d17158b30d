"""What the supervisor hands each child at start: one frozen record per kind of child, the entry point's only
argument.

Named fields instead of positional arguments, so the supervisor and the entry points cannot disagree on an
order (engines and API servers once took `ready` and `lifeline` the opposite way round). The records travel
through multiprocessing `spawn`: the pipes and the listening socket inside them are duplicated into the child
as they are pickled, like any Connection or socket argument.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ipc.anonymous_memory import MemoryHandle
from ipc.config import ServeConfig
from ipc.curve import CurveKeys
from ipc.model_info import ModelInfo
from ipc.sockets import engine_address


@dataclass(frozen=True)
class EngineLaunch:
    config: ServeConfig
    rank: int  # data-parallel rank: EngineCore_DP<rank>
    ready: Connection  # the child's write end: exactly one EngineReady or EngineFailed
    lifeline: Connection  # the child's read end: EOF when the supervisor is gone
    # Where its ROUTER binds: tcp:// on a headless node (port `*`: any free one); "" is the group's ipc:// address.
    address: str = ""
    curve: CurveKeys | None = None  # the deployment's key: a TCP ROUTER admits only its holders

    @property
    def endpoint(self) -> str:
        return self.address or engine_address(self.config.runtime_dir, self.rank)


@dataclass(frozen=True)
class ApiServerLaunch:
    config: ServeConfig
    index: int  # identity, not position: ApiServer_<index>, ZMQ identity api-<index>, shared-memory slot <index>
    listen_socket: socket.socket  # already listening, shared by the whole group
    model: ModelInfo
    engine_addresses: tuple[str, ...]  # one per engine this group reaches, in rank order
    shared_state: MemoryHandle  # the ipc.shared_state.GroupState to attach (a descriptor: the block has no name)
    ready: Connection  # the child's write end: True once it serves
    lifeline: Connection  # the child's read end: EOF when the supervisor is gone
    engine_ranks: tuple[int, ...] = ()  # the data-parallel rank of each address (() : 0, 1, ...)
    curve: CurveKeys | None = None  # the deployment's key, for engines on TCP
