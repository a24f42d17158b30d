"""Sequence: one choice of one request as the engine tracks it, from waiting to finished."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from enginecore.block_pool import hash_block
from ipc.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not content: two sequences with equal tokens are still two sequences
class Sequence:
    seq_id: int
    request_id: str
    client: bytes | None  # the API server that asked (None in-process); outputs go back to it
    index: int  # which of the request's n choices
    token_ids: list[int]  # prompt, then every token generated so far
    num_prompt_tokens: int
    sampling: SamplingParams
    # Scheduling order: (priority, arrival); lower runs first and is preempted last.
    priority: int
    arrival: int
    generator: torch.Generator | None = None  # per-request seed: the same draws whatever the batch
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at admission
    num_forks_pending: int = 0  # choices still to fork from this one once its prompt is computed
    block_hashes: list[int] = field(default_factory=list)  # content hashes of the leading full blocks
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0
    # Prompt logprobs (sampling.prompt_logprobs): how many prompt positions (from the second) have theirs, and
    # those not sent yet (None: nothing to send, or sent). They go out once, with the sequence's first output; a
    # recompute after preemption does not compute them again. Forked choices have none to send.
    num_prompt_logprobs: int = 0
    pending_prompt_logprobs: list | None = None
    grammar: object | None = None  # structured outputs: its matcher (enginecore.structured_output.GrammarState)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.priority, self.arrival, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Content hashes of the first `num_blocks` full blocks of token_ids, computed once and kept."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return hashes[:num_blocks]
