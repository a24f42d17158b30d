"""One block of shared memory for the whole group, made by the supervisor and attached by every API server.

Each API server owns one slot and is its only writer (open connections, in-flight requests, heartbeat,
admitted requests and tokens); the supervisor zeroes a slot only once its server is dead. The group-wide
admission totals are the sums over the slots, with no lock: a server counts a request into its own slot
first and then sums every slot (apiserver/admission.py), so a server that dies at any point leaves nothing
held but its own counts, which the supervisor releases with its slot. The admission counters are read and
written with sequentially consistent atomics (atomicshm): plain stores could be reordered after the loads
that follow them, and two servers could then each miss the other's count.

The block has no name (ipc/anonymous_memory.py): the children get it as a file descriptor, so however the group
ends, even with every process SIGKILLed, nothing is left behind in /dev/shm.
"""
from __future__ import annotations

import mmap
import os
import struct
import time

import atomicshm

from ipc.anonymous_memory import MemoryHandle, anonymous_memory

MAX_SLOTS = 128
MAX_RANKS = 64  # --data-parallel-size's bound
# open_connections, in_flight, heartbeat, pid, admitted requests, admitted prompt tokens
_SLOT = struct.Struct("<qqdqqq")
_FIELDS = 6
_GLOBAL = struct.Struct("<qq")  # version of the rank marks (bumped on every change), group stopping
_GLOBAL_OFFSET = MAX_SLOTS * _SLOT.size
_RANKS_OFFSET = _GLOBAL_OFFSET + _GLOBAL.size  # one int64 per data-parallel rank: 0 live, else a RANK_DOWN code
# Per slot, one int64 per rank: that server's requests in flight at the rank (the balancer's group-wide view).
_RANK_FLIGHT_OFFSET = _RANKS_OFFSET + MAX_RANKS * 8
SIZE = _RANK_FLIGHT_OFFSET + MAX_SLOTS * MAX_RANKS * 8

# Why a rank is marked down, as the API servers tell clients.
RANK_EXITED, RANK_NODE_SILENT, RANK_NODE_LEFT = 1, 2, 3
RANK_DOWN = {
    RANK_EXITED: "its engine core exited",
    RANK_NODE_SILENT: "its node stopped sending heartbeats",
    RANK_NODE_LEFT: "its node went away",
}
# Not down: its node is stopping. It finishes the requests it has and is sent no new ones.
RANK_DRAINING = 4

_OPEN, _IN_FLIGHT, _HEARTBEAT, _PID, _ADMITTED_REQUESTS, _ADMITTED_TOKENS = range(_FIELDS)


class GroupState:
    def __init__(self, handle: MemoryHandle, owner: bool):
        """`owner` (the supervisor) keeps the descriptor, to hand it to every child it spawns; a child needs only
        the mapping."""
        self._map = mmap.mmap(handle.fd, SIZE)
        self._handle: MemoryHandle | None = handle
        if not owner:
            os.close(handle.fd)
            self._handle = None
        buf = memoryview(self._map)
        # Typed views over the same bytes: one int64 view and one float64 view.
        self._ints = buf.cast("q")
        self._floats = buf.cast("d")
        buf.release()
        # Atomic cells for the admission counters, bound once per slot (the bounds checks happen here).
        self._atomics = atomicshm.AtomicView(self._map)
        self._admitted_requests = [self._cell(slot, _ADMITTED_REQUESTS) for slot in range(MAX_SLOTS)]
        self._admitted_tokens = [self._cell(slot, _ADMITTED_TOKENS) for slot in range(MAX_SLOTS)]

    @classmethod
    def create(cls) -> "GroupState":
        """A new block, all zeros."""
        return cls(anonymous_memory("supervise-group-state", SIZE), owner=True)

    @classmethod
    def attach(cls, handle: MemoryHandle) -> "GroupState":
        """The block `handle` names: `handle`, received from the owner, is used up."""
        return cls(handle, owner=False)

    @property
    def handle(self) -> MemoryHandle:
        """What a child is given (in its launch record) to attach this block; only the owner has one."""
        assert self._handle is not None, "only the group's owner hands the block on"
        return self._handle

    def _cell(self, slot: int, field: int) -> atomicshm.AtomicU64:
        return self._atomics.cell_u64(self._at(slot, field) * 8)

    def close(self) -> None:
        self._admitted_requests = self._admitted_tokens = []
        self._atomics.close()
        self._ints.release()
        self._floats.release()
        self._map.close()
        if self._handle is not None:
            os.close(self._handle.fd)
            self._handle = None

    # Per-slot fields. Slot i starts at 8-byte index i*_FIELDS.
    def _at(self, slot: int, field: int) -> int:
        if not 0 <= slot < MAX_SLOTS:
            raise IndexError(f"slot {slot} out of range")
        return slot * _FIELDS + field

    def open_connections(self, slot: int) -> int:
        return self._ints[self._at(slot, _OPEN)]

    def set_open_connections(self, slot: int, value: int) -> None:
        self._ints[self._at(slot, _OPEN)] = value

    def in_flight(self, slot: int) -> int:
        return self._ints[self._at(slot, _IN_FLIGHT)]

    def set_in_flight(self, slot: int, value: int) -> None:
        self._ints[self._at(slot, _IN_FLIGHT)] = value

    def heartbeat(self, slot: int) -> float:
        return self._floats[self._at(slot, _HEARTBEAT)]

    def beat(self, slot: int) -> None:
        self._floats[self._at(slot, _HEARTBEAT)] = time.monotonic()

    def pid(self, slot: int) -> int:
        return self._ints[self._at(slot, _PID)]

    def claim(self, slot: int, pid: int) -> None:
        """A (new) server takes slot: counters start at zero, the heartbeat at now."""
        self._zero_counters(slot)
        self._ints[self._at(slot, _PID)] = pid
        self.beat(slot)

    def release(self, slot: int) -> None:
        """The server in slot is gone: it no longer counts when others balance accepts or admit requests."""
        self._zero_counters(slot)
        self._ints[self._at(slot, _PID)] = 0

    def _zero_counters(self, slot: int) -> None:
        for field in (_OPEN, _IN_FLIGHT):
            self._ints[self._at(slot, field)] = 0
        row = self._rank_row(slot)
        for i in range(row, row + MAX_RANKS):
            self._ints[i] = 0
        self._admitted_requests[slot].store(0)
        self._admitted_tokens[slot].store(0)

    def least_open_connections(self) -> int:
        """The fewest open connections among live servers (pid set)."""
        best = None
        for base in range(0, MAX_SLOTS * _FIELDS, _FIELDS):
            if self._ints[base + _PID]:
                n = self._ints[base + _OPEN]
                best = n if best is None or n < best else best
        return best or 0

    # Requests in flight per rank (apiserver/engine_loads.py balances on the group's sums). Only the server that
    # owns `slot` writes its row; an aligned int64 store is whole, so a reader sees each count old or new.
    def _rank_row(self, slot: int) -> int:
        if not 0 <= slot < MAX_SLOTS:
            raise IndexError(f"slot {slot} out of range")
        return _RANK_FLIGHT_OFFSET // 8 + slot * MAX_RANKS

    def add_in_flight_at(self, slot: int, rank: int, delta: int) -> None:
        self._ints[self._rank_row(slot) + rank] += delta

    def in_flight_at(self, ranks: list[int]) -> list[int]:
        """Requests in flight at each of `ranks`, summed over every live API server."""
        totals = [0] * len(ranks)
        ints = self._ints
        for slot in range(MAX_SLOTS):
            if ints[slot * _FIELDS + _PID]:
                row = _RANK_FLIGHT_OFFSET // 8 + slot * MAX_RANKS
                for i, rank in enumerate(ranks):
                    totals[i] += ints[row + rank]
        return totals

    # Group-wide admission (the protocol is in apiserver/admission.py).
    def admitted(self) -> tuple[int, int]:
        """Requests and prompt tokens counted in, over every server of the group (one atomic load per slot)."""
        requests = sum(cell.load() for cell in self._admitted_requests)
        tokens = sum(cell.load() for cell in self._admitted_tokens)
        # Counters wrap at 64 bits (a release is an add of a negative number): the sum, taken modulo 2**64, is
        # the signed total.
        return atomicshm.as_signed(requests % 2**64, 64), atomicshm.as_signed(tokens % 2**64, 64)

    def add_admitted(self, slot: int, requests: int, tokens: int) -> None:
        """Only the server that owns `slot` calls this."""
        self._admitted_requests[slot].fetch_add(requests)
        self._admitted_tokens[slot].fetch_add(tokens)

    # Set by the supervisor when an engine core dies without a word (kill -9, OOM) or a remote rank is lost (its
    # node went away or fell silent): the API servers then fail its requests at once and send it no more. Cleared
    # when a lost remote rank registers again (--on-engine-failure restart).
    def ranks_version(self) -> int:
        """Changes whenever a rank is marked down or up: a reader rescans `down_ranks` only then."""
        return self._ints[_GLOBAL_OFFSET // 8]

    def down_ranks(self) -> dict[int, str]:
        """Rank -> why it is down, for every rank marked down."""
        base = _RANKS_OFFSET // 8
        return {rank: RANK_DOWN.get(code, "it is gone") for rank in range(MAX_RANKS)
                if (code := self._ints[base + rank]) and code != RANK_DRAINING}

    def draining_ranks(self) -> set[int]:
        """The ranks whose node is stopping: their requests run on, new ones go elsewhere."""
        base = _RANKS_OFFSET // 8
        return {rank for rank in range(MAX_RANKS) if self._ints[base + rank] == RANK_DRAINING}

    def mark_engine_dead(self, rank: int, why: int = RANK_EXITED) -> None:
        self._mark_rank(rank, why)

    def mark_rank_draining(self, rank: int) -> None:
        self._mark_rank(rank, RANK_DRAINING)

    def mark_engine_live(self, rank: int) -> None:
        self._mark_rank(rank, 0)

    def _mark_rank(self, rank: int, code: int) -> None:
        self._ints[_RANKS_OFFSET // 8 + rank] = code
        self._ints[_GLOBAL_OFFSET // 8] += 1

    # Set by the supervisor before it stops the API servers for good (not when it drains one that a new
    # server replaces): a draining server then answers new requests 503 instead of serving them.
    def group_stopping(self) -> bool:
        return bool(self._ints[_GLOBAL_OFFSET // 8 + 1])

    def mark_group_stopping(self) -> None:
        self._ints[_GLOBAL_OFFSET // 8 + 1] = 1
