"""One block of shared memory for the whole group, made by the supervisor and attached by every API server.

Each API server owns one slot and is its only writer (open connections, in-flight requests, heartbeat), so no
lock is needed for those. The group-wide admission counters are shared by all servers and only change under
the group's lock (a multiprocessing.Lock handed to every server).
"""
from __future__ import annotations

import struct
import time
from multiprocessing import shared_memory

MAX_SLOTS = 128
_SLOT = struct.Struct("<qqdqq")  # open_connections, in_flight, heartbeat, pid, generation
_GLOBAL = struct.Struct("<qqqq")  # admitted requests, admitted prompt tokens, dead engine rank + 1, spare
_GLOBAL_OFFSET = MAX_SLOTS * _SLOT.size
SIZE = _GLOBAL_OFFSET + _GLOBAL.size

_OPEN, _IN_FLIGHT, _HEARTBEAT, _PID, _GENERATION = range(5)


class GroupState:
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self._shm = shm
        self._owner = owner
        self.name = shm.name
        # Typed views over the same bytes: one int64 view and one float64 view.
        self._ints = shm.buf.cast("q")
        self._floats = shm.buf.cast("d")

    @classmethod
    def create(cls) -> "GroupState":
        shm = shared_memory.SharedMemory(create=True, size=SIZE)
        shm.buf[:SIZE] = bytes(SIZE)
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "GroupState":
        return cls(shared_memory.SharedMemory(name=name), owner=False)

    def close(self) -> None:
        self._ints.release()
        self._floats.release()
        self._shm.close()
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    # Per-slot fields. Slot i starts at int64 index i*5.
    def _at(self, slot: int, field: int) -> int:
        if not 0 <= slot < MAX_SLOTS:
            raise IndexError(f"slot {slot} out of range")
        return slot * 5 + field

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
        self.set_open_connections(slot, 0)
        self.set_in_flight(slot, 0)
        self._ints[self._at(slot, _PID)] = pid
        self.beat(slot)

    def release(self, slot: int) -> None:
        """The server in slot is gone: it no longer counts when others balance accepts."""
        self.set_open_connections(slot, 0)
        self.set_in_flight(slot, 0)
        self._ints[self._at(slot, _PID)] = 0

    def least_open_connections(self) -> int:
        """The fewest open connections among live servers (pid set)."""
        best = None
        for slot in range(MAX_SLOTS):
            if self._ints[slot * 5 + _PID]:
                n = self._ints[slot * 5 + _OPEN]
                best = n if best is None or n < best else best
        return best or 0

    # Group-wide admission counters; callers hold the group lock.
    def admitted(self) -> tuple[int, int]:
        base = _GLOBAL_OFFSET // 8
        return self._ints[base], self._ints[base + 1]

    def add_admitted(self, requests: int, tokens: int) -> None:
        base = _GLOBAL_OFFSET // 8
        self._ints[base] += requests
        self._ints[base + 1] += tokens

    # Set by the supervisor when it sees an engine core die without a word (kill -9, OOM): the API servers
    # then answer 503 at once instead of waiting on an engine that will never reply.
    def dead_engine(self) -> int | None:
        """The rank of an engine core that died, or None while all live."""
        value = self._ints[_GLOBAL_OFFSET // 8 + 2]
        return value - 1 if value else None

    def mark_engine_dead(self, rank: int) -> None:
        self._ints[_GLOBAL_OFFSET // 8 + 2] = rank + 1
