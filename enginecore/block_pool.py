"""KVBlockPool: which KV cache blocks are free, who holds each block, and which full blocks hold what content.

Pure bookkeeping (no tensors): the scheduler asks it for blocks, sequences keep the ids in their block tables.

A block is shared by reference count: n>1 choices of one request share their prompt's blocks, and with prefix
caching sequences whose prompts start alike share the full blocks of that prefix. A full block is known by a
content hash that chains the hash of the block before it, so equal hashes mean equal whole prefixes.

A freed block that has a hash is not wiped: it stays findable (an LRU of evictable blocks) until its memory is
needed for something else, so a repeated system prompt is computed once even when the requests do not overlap.
"""
from __future__ import annotations

from collections import OrderedDict


def hash_block(parent_hash: int | None, token_ids) -> int:
    """The content hash of a full block whose prefix hashes to parent_hash."""
    return hash((parent_hash, tuple(token_ids)))


class NoFreeBlocks(Exception):
    pass


class KVBlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Blocks never used or wiped; popped from the end, so low ids are handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that still hold a cached prefix, oldest first: reused on a hit, evicted when needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # content hash -> block id

    # --- counting -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    # --- allocation -----------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise NoFreeBlocks
        self.ref_count[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks
        return [self.allocate() for _ in range(n)]

    def share(self, block: int) -> None:
        """One more holder of `block` (a forked choice)."""
        self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        # Free the tail first: evictable blocks are evicted oldest first, and a prefix's last block is the least
        # useful one to keep (a later hit needs every block before it).
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] > 0:
                continue
            if self.block_hash[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # --- prefix caching -------------------------------------------------------------------------------------
    def lookup(self, block_hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `block_hashes` that is cached, now held by the caller."""
        hits = []
        if not self.enable_prefix_caching:
            return hits
        for h in block_hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if self.ref_count[block] == 0:
                del self._evictable[block]
            self.ref_count[block] += 1
        return hits

    def register(self, block: int, block_hash: int) -> None:
        """`block` is full and its KV computed: make it findable by content."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self._cached:  # another sequence computed the same content first: keep that one
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Blocks in use keep their content but are no longer shared with newcomers."""
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
        self._evictable.clear()
        for block_hash, block in list(self._cached.items()):
            self.block_hash[block] = None
        self._cached.clear()
        return True

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
