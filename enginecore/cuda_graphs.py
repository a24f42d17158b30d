"""CudaGraphRunner: decode-only steps replayed from CUDA graphs, everything else eager. Only imported on CUDA.

A decode step of a small model is hundreds of tiny kernels: launching them one by one from Python costs more than
running them. A graph is captured per (batch size, blocks per sequence) bucket, lazily on first use, and replayed
after copying the step's inputs into that graph's static buffers. The batch is padded to its bucket: padding
rows compute garbage that nobody samples and write their K/V into the cache's scratch block.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from enginecore.model_runner import ModelRunner
from enginecore.sequence import Sequence
from enginecore.step_inputs import DecodePadding, StepInputs, build_step_inputs

log = logging.getLogger(__name__)

# Contexts longer than this decode eagerly: their gather dominates, launches do not.
MAX_GRAPH_CONTEXT = 8192
# Graphs gather at least this many tokens per sequence: on a GPU a short context costs about the same, and fewer
# shapes mean fewer graphs.
MIN_GRAPH_CONTEXT = 256


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs  # the static buffers the graph reads
    logits: torch.Tensor  # the static output it writes


class CudaGraphRunner:
    def __init__(self, eager: ModelRunner, max_num_seqs: int, max_model_len: int):
        self.eager = eager
        self.device = eager.device
        self.block_size = eager.block_size
        self.kv_cache = eager.kv_cache
        self.batch_buckets = batch_buckets(max_num_seqs)
        max_blocks = -(-min(max_model_len, MAX_GRAPH_CONTEXT) // self.block_size)
        smallest = min(max_blocks, -(-MIN_GRAPH_CONTEXT // self.block_size))
        self.block_buckets = [smallest << i for i in range(max_blocks.bit_length()) if smallest << i < max_blocks]
        self.block_buckets.append(max_blocks)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def capture_common(self) -> None:
        """Capture every batch size for the shortest contexts now, so serving starts without capture pauses;
        longer contexts are captured when first seen. Largest first, so the smaller reuse its memory pool."""
        started = time.monotonic()
        for batch in reversed(self.batch_buckets):
            padding = DecodePadding(batch, self.block_buckets[0], self.kv_cache.scratch_block)
            shape = (batch, padding.blocks)
            example = build_step_inputs([], self.block_size, self.device, padding, self.eager.varlen)
            self._graphs[shape] = self._capture(example)
        log.info("captured %d CUDA graphs in %.1f s", len(self._graphs), time.monotonic() - started)

    @property
    def model(self):
        return self.eager.model

    def prepare(self, entries: list[tuple[Sequence, int]]) -> StepInputs:
        padding = self._padding(entries)
        if padding is None:
            return self.eager.prepare(entries)
        return build_step_inputs(entries, self.block_size, self.device, padding, self.eager.varlen)

    def _padding(self, entries) -> DecodePadding | None:
        if not entries or entries[-1][1] != 1 or len(entries) > self.batch_buckets[-1]:
            return None  # some prefill in the batch, or too many rows
        context = 0
        for seq, _ in entries:
            length = seq.num_computed_tokens + 1
            if length != len(seq.token_ids):
                # A one-token chunk of a prompt, not a decode: a graph samples every row, and this row is not
                # to be sampled (it may owe prompt logprobs instead).
                return None
            if length > context:
                context = length
        ctx_blocks = -(-context // self.block_size)
        if ctx_blocks > self.block_buckets[-1]:
            return None
        batch = self.batch_buckets[bisect.bisect_left(self.batch_buckets, len(entries))]
        blocks = self.block_buckets[bisect.bisect_left(self.block_buckets, ctx_blocks)]
        return DecodePadding(batch, blocks, self.kv_cache.scratch_block)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.graph_shape is None:
            return self.eager.forward(inputs)
        graph = self._graphs.get(inputs.graph_shape)
        if graph is None:
            graph = self._graphs[inputs.graph_shape] = self._capture(inputs)
        for static, new in zip(_device_tensors(graph.inputs), _device_tensors(inputs)):
            static.copy_(new, non_blocking=True)
        graph.graph.replay()
        return graph.logits[: len(inputs.sample_seqs)]

    def _capture(self, example: StepInputs) -> _Graph:
        started = time.monotonic()
        # The graph's own copies of the inputs: every replay copies the step's values into them.
        static = copy.deepcopy(dataclasses.replace(example, sample_seqs=[]))
        # Warm up on a side stream (as torch's graph docs ask); it writes what the replay will write.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.eager.forward(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            logits = self.eager.forward(static)  # the lean forward, or transformers'
        log.debug("captured a CUDA graph for %d sequences x %d blocks in %.2f s", *example.graph_shape,
                  time.monotonic() - started)
        return _Graph(graph, static, logits)


def _device_tensors(inputs: StepInputs) -> list[torch.Tensor]:
    """The tensors a decode graph reads, in a fixed order."""
    a = inputs.attention
    tensors = [inputs.input_ids, inputs.positions, a.slot_mapping]
    if a.varlen is not None:
        # cu_q and cu_k are the bucket's shape (one query and `blocks` whole blocks per row): the graph's own copies
        # already hold them.
        return tensors + [a.varlen.kv_blocks, a.varlen.seqused_k]
    return tensors + [a.decode_blocks, a.decode_mask]
