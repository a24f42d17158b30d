"""KVBlockPool: which KV cache blocks are free, who holds each block, and which full blocks hold what content.

Pure bookkeeping (no tensors). The pool owns every block's reference count and every sequence's block table; the
scheduler and the engine speak to it in per-sequence verbs (nano-vllm's vocabulary):
  lookup_prefix(seq)         a sequence about to compute its prompt takes the cached blocks of its longest cached
                             prefix
  can_append(seq, n) / append(seq, n)
                             is there room for seq's next n tokens / make it: new blocks at the end, and a private
                             copy of a shared block they would write into (copy-on-write)
  fork(parent, child)        the child shares every block of the parent (the other n-1 choices of a request)
  free(seq)                  seq gives its blocks back (finished, aborted, preempted)
  register_full_blocks(seq)  seq's full, computed blocks become findable by content

A block is shared by reference count: n>1 choices of one request share their prompt's blocks, and with prefix
caching sequences whose prompts start alike share the full blocks of that prefix. A freed block that is cached is
not wiped: it stays findable (an LRU of evictable blocks) until its memory is needed for something else, so a
repeated system prompt is computed once even when the requests do not overlap.

A full block is known by a SHA-256 digest chained over its parent block's digest and its own token ids, as vLLM
does since its advisory: Python's hash() of an int tuple is deterministic across processes and cheap to collide
on purpose, and a collision would serve one client's cached KV to another's prompt. Belt and braces, each cached
block also keeps the exact (parent digest, token ids) it was registered with, compared on every hit: a hit needs
equal content, not only an equal digest.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from enginecore.sequence import Sequence


def hash_block(parent: bytes | None, token_ids) -> bytes:
    """The content digest of a full block whose prefix (every block before it) has the digest `parent`."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        # A cached block's digest and the content it was registered with: (parent digest, token ids).
        self._digest: list[bytes | None] = [None] * num_blocks
        self._content: list[tuple | None] = [None] * num_blocks
        # Blocks never used or wiped; popped from the end, so low ids are handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks that still hold a cached prefix, oldest first: reused on a hit, evicted when needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # digest -> block id

    # --- counting -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def ref_counts(self) -> list[int]:
        """Every block's reference count, by block id (read only: the pool's verbs change it)."""
        return self._ref_count

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    # --- per-sequence verbs ---------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> None:
        """seq holds no block yet: give it the cached blocks of its longest cached prefix, as computed tokens. At
        least its last token is left to compute (its logits give the next token); a sequence that owes prompt
        logprobs computes every prompt position (as in vLLM)."""
        num_full = (seq.num_tokens - 1) // self.block_size
        if num_full == 0 or not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return
        digests = self._digests(seq, num_full)
        hits: list[int] = []
        for i, digest in enumerate(digests):
            block = self._cached.get(digest)
            if block is None or self._content[block] != (digests[i - 1] if i else None, self._tokens(seq, i)):
                break
            hits.append(block)
        for block in hits:
            if self._ref_count[block] == 0:
                del self._evictable[block]
            self._ref_count[block] += 1
        seq.block_table = hits
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def can_append(self, seq: Sequence, n: int, reserve: int = 0) -> bool:
        """Room for seq's next n tokens, with `reserve` blocks still free afterwards."""
        return self._blocks_needed(seq, n) + len(self._shared_written(seq)) + reserve <= self.num_free

    def append(self, seq: Sequence, n: int) -> list[tuple[int, int]]:
        """Give seq the blocks its next n tokens go to (after can_append said yes). Returns the (source,
        destination) block copies to make before the forward pass: a shared block seq is about to write into
        becomes its own copy (a forked choice's partial last prompt block)."""
        copies = []
        table = seq.block_table
        for i in self._shared_written(seq):
            new = self._take_block()
            copies.append((table[i], new))
            self._release([table[i]])
            table[i] = new
        table.extend(self._take_block() for _ in range(self._blocks_needed(seq, n)))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (each choice writes its own copy of a shared block later)."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self._ref_count[block] += 1

    def free(self, seq: Sequence) -> None:
        """seq gives its blocks back; its computed tokens are gone with them (a preempted one recomputes)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the blocks seq has filled and computed findable by content."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        digests = self._digests(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block, digest = seq.block_table[i], digests[i]
            # Already cached (a hit, or a forked choice's shared block), or another sequence computed the same
            # content first: keep that one.
            if self._digest[block] is None and digest not in self._cached:
                self._digest[block] = digest
                self._content[block] = (digests[i - 1] if i else None, self._tokens(seq, i))
                self._cached[digest] = block
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Blocks in use keep their content but are no longer shared with newcomers."""
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
        self._evictable.clear()
        for block in self._cached.values():
            self._digest[block] = self._content[block] = None
        self._cached.clear()
        return True

    # --- blocks ---------------------------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table))

    def _shared_written(self, seq: Sequence) -> list[int]:
        """Positions in seq's block table of the blocks its next tokens write into that others hold too."""
        table = seq.block_table
        return [i for i in range(seq.num_computed_tokens // self.block_size, len(table))
                if self._ref_count[table[i]] > 1]

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # can_append made sure there is one
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._ref_count[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        # Free the tail first: evictable blocks are evicted oldest first, and a prefix's last block is the least
        # useful one to keep (a later hit needs every block before it).
        for block in reversed(blocks):
            self._ref_count[block] -= 1
            if self._ref_count[block] > 0:
                continue
            if self._digest[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _forget(self, block: int) -> None:
        digest = self._digest[block]
        if digest is not None:
            self._digest[block] = self._content[block] = None
            if self._cached.get(digest) == block:
                del self._cached[digest]

    # --- content --------------------------------------------------------------------------------------------
    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The digests of seq's first num_blocks full blocks, computed once and kept on seq."""
        digests = seq.block_hashes
        size = self.block_size
        while len(digests) < num_blocks:
            i = len(digests)
            digests.append(hash_block(digests[-1] if digests else None, seq.token_ids[i * size:(i + 1) * size]))
        return digests[:num_blocks]
