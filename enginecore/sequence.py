"""Sequence: one choice of one request as the engine tracks it, from waiting to finished.

No torch import here: the simulated engine (enginecore.simulated) tracks its sequences with this class too.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipc.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


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
    # Scheduling order (key): priority, then turn + index, then arrival; lower runs first and is preempted last.
    priority: int
    arrival: int
    generator: torch.Generator | None = None  # per-choice seed: the same draws whatever the batch
    status: SequenceStatus = SequenceStatus.WAITING
    # The KV cache state below belongs to the block pool (enginecore.block_pool): only its verbs change it.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # content digests of the leading full blocks
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at admission
    # The request's other choices (their indices), still to fork from this one once its prompt is computed. While
    # any is pending this sequence has sent nothing yet.
    pending_forks: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Prompt logprobs (sampling.prompt_logprobs): how many prompt positions (from the second) have theirs, and
    # those not sent yet (None: nothing to send, or sent). They go out once, with the sequence's first output; a
    # recompute after preemption does not compute them again. Forked choices have none to send.
    num_prompt_logprobs: int = 0
    pending_prompt_logprobs: list | None = None
    grammar: object | None = None  # structured outputs: its matcher (enginecore.structured_output.GrammarState)
    # sampling.stop_token_ids as a set, made once per request: the check runs for every token, and a request may
    # list the whole vocabulary (a list of a million ids once made every step of its engine take 2.4 s).
    stop_token_ids: frozenset[int] = frozenset()  # made from sampling's if not given (a fork shares its parent's)
    min_tokens_barred: object | None = None  # the ids barred until min_tokens, on the device (the sampler's)
    logit_bias: object | None = None  # sampling's logit bias as (ids, values) on the device, made by the sampler once
    # The request's place in the fair share of the engine's slots (enginecore.scheduler): the scheduler's clock when
    # it came plus its prompt's ordinal in its API request. Its choice `index` takes its turn `index` later.
    turn: int = 0

    def __post_init__(self):
        if not self.stop_token_ids and self.sampling.stop_token_ids:
            self.stop_token_ids = frozenset(self.sampling.stop_token_ids)

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.priority, self.turn + self.index, self.arrival, self.index)

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

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None) -> Sequence:
        """Choice `index` of the same request, at the same point: same tokens, same computed prompt, a copy of
        its grammar's matcher. Its blocks are the pool's to share (KVBlockPool.fork)."""
        return Sequence(
            seq_id=seq_id, request_id=self.request_id, client=self.client, index=index,
            token_ids=list(self.token_ids), num_prompt_tokens=self.num_prompt_tokens, sampling=self.sampling,
            priority=self.priority, arrival=self.arrival, generator=generator,
            num_computed_tokens=self.num_computed_tokens, block_hashes=list(self.block_hashes),
            num_registered_blocks=self.num_registered_blocks, num_cached_tokens=self.num_cached_tokens,
            num_prompt_logprobs=self.num_prompt_logprobs,
            grammar=None if self.grammar is None else self.grammar.fork(),
            stop_token_ids=self.stop_token_ids, min_tokens_barred=self.min_tokens_barred,
            logit_bias=self.logit_bias, turn=self.turn,
        )
