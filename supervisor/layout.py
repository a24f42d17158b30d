"""Which data-parallel ranks this node runs, which it waits for, and where each engine listens.

Four layouts, from vLLM's flags:
- one node (the default): ranks 0..K-1, all local;
- a head (`--data-parallel-size-local L` < K): ranks 0..L-1 here, ranks L..K-1 register from headless nodes
  with the registration port (`--data-parallel-address`:`--data-parallel-rpc-port`);
- a headless node (`--headless --data-parallel-start-rank S --data-parallel-size-local L`): ranks S..S+L-1,
  engines only, on TCP, registered with the head;
- one rank of an externally balanced deployment (`--data-parallel-rank r`): a whole group that serves rank r
  alone, for a router in front of K such groups.
Local engines of a group with API servers listen on ipc:// in the runtime directory; a headless node's on TCP.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from ipc.config import ServeConfig
from ipc.sockets import engine_address, tcp_address


class BadLayout(ValueError):
    """Options that do not make a deployment (one line, exit 2)."""


@dataclass(frozen=True)
class Layout:
    size: int  # --data-parallel-size: ranks in the whole deployment
    local_ranks: tuple[int, ...]  # the engines this node starts
    remote_ranks: tuple[int, ...]  # the engines a head waits for (registered by headless nodes)
    headless: bool = False
    external: bool = False  # --data-parallel-rank: one rank of a deployment balanced by a router

    @property
    def served_ranks(self) -> tuple[int, ...]:
        """The ranks this group's API servers reach, in order."""
        return tuple(sorted(self.local_ranks + self.remote_ranks))

    def describe(self) -> str:
        ranks = _span(self.local_ranks)
        if self.external:
            return f"rank {ranks} of {self.size} (balanced by a router)"
        if self.remote_ranks:
            return f"ranks {ranks} here, {_span(self.remote_ranks)} on headless nodes"
        return f"ranks {ranks}" + (f" of {self.size}" if self.headless else "")


def layout_of(config: ServeConfig) -> Layout:
    """Raises BadLayout naming the options that conflict."""
    size, local, start = config.data_parallel_size, config.data_parallel_size_local, config.data_parallel_start_rank
    if config.data_parallel_rank is not None:
        rank = config.data_parallel_rank
        if config.headless:
            raise BadLayout("--data-parallel-rank runs a whole group for one rank; it cannot be --headless")
        if rank >= size:
            raise BadLayout(f"--data-parallel-rank {rank} is out of range for --data-parallel-size {size}")
        if local not in (None, 1) or start != 0:
            raise BadLayout("--data-parallel-rank runs one engine: leave out --data-parallel-size-local and "
                            "--data-parallel-start-rank")
        return Layout(size, (rank,), (), external=True)
    if config.headless:
        if start < 1:
            raise BadLayout("a --headless node needs --data-parallel-start-rank 1 or more (the head runs rank 0)")
        local = size - start if local is None else local
        if local < 1 or start + local > size:
            raise BadLayout(f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} does not fit "
                            f"--data-parallel-size {size}")
        return Layout(size, tuple(range(start, start + local)), (), headless=True)
    if start != 0:
        raise BadLayout("--data-parallel-start-rank is for --headless nodes; the head runs ranks from 0")
    local = size if local is None else local
    if local < 1:
        raise BadLayout("the head needs at least one local engine (--data-parallel-size-local 1 or more): its API "
                        "servers take the tokenizer from it")
    if local > size:
        raise BadLayout(f"--data-parallel-size-local {local} is more than --data-parallel-size {size}")
    return Layout(size, tuple(range(local)), tuple(range(local, size)))


def local_engine_address(config: ServeConfig, layout: Layout, rank: int, engine_host: str) -> str:
    """Where local engine `rank` binds: ipc:// beside API servers, TCP on a headless node."""
    if not layout.headless:
        return engine_address(config.runtime_dir, rank)
    base = config.data_parallel_engine_port
    return tcp_address(engine_host, base + rank - layout.local_ranks[0] if base else 0)


def engine_host_toward(head: str, port: int) -> str:
    """The address of this machine's interface on the route to the head: what a headless node's engines bind
    (never 0.0.0.0: an engine port listens only where the head can reach it)."""
    family = socket.AF_INET6 if ":" in head else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((head, port))  # UDP: no packet is sent, the kernel only picks the route
        return probe.getsockname()[0]


def _span(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "none"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
