"""CudaGraphRunner: engine steps replayed from CUDA graphs. Only imported on CUDA (tests drive it on the CPU with a
stand-in for the capture).

A step of a small model is hundreds of tiny kernels: launching them one by one from Python costs more than running
them. Graphs are captured lazily, per bucket of shapes, and replayed after copying the step's inputs into that
graph's static buffers; the step is padded to its bucket. Two kinds:

- decode-only steps: the whole forward pass, LM head included, per (batch size, blocks per sequence). Padding rows
  compute garbage that nobody samples and write their K/V into the cache's scratch block. Every batch size is
  captured at start-up for the shortest contexts (START_UP_BLOCK_BUCKETS).
- steps with prompt tokens (a closed loop of clients makes nearly every step one: new requests' prefills join the
  running decodes), where varlen attention runs (CUDA, half precision, either kernel) and the lean forward does:
  the layers only, per (tokens, runs, context blocks in all) (step_inputs.MixedPadding); the final norm and the LM
  head run eagerly on the rows the step samples, whatever their number. At most --cuda-graph-max-tokens tokens: beyond,
  the products dominate and launches do not matter. At most MAX_MIXED_GRAPHS such graphs, all writing their
  output into one buffer. Without this, such a step launched some 500 kernels from
  Python one by one (SmolLM2-135M), longer than the GPU took to run them.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from enginecore.model_runner import ModelRunner
from enginecore.sequence import Sequence
from enginecore.step_inputs import DecodePadding, MixedPadding, StepInputs, build_step_inputs

log = logging.getLogger(__name__)

# Contexts longer than this decode eagerly: their gather dominates, launches do not.
MAX_GRAPH_CONTEXT = 8192
# Graphs gather at least this many tokens per sequence: on a GPU a short context costs about the same, and fewer
# shapes mean fewer graphs.
MIN_GRAPH_CONTEXT = 256
# Context buckets whose decode graphs are captured at start-up, every batch size each: a chat of a few hundred
# tokens (a 128-token prompt, its template and 128 new ones come to about 290) would otherwise pause serving for a
# capture at each batch size it reaches past the first bucket.
START_UP_BLOCK_BUCKETS = 2

# Graphs of steps with prompt tokens kept at most: their shapes vary with the load (a closed loop of clients settles
# on about a dozen), and each costs a capture pause; beyond this, steps of new shapes run eagerly.
MAX_MIXED_GRAPHS = 256

# capture(fn) -> (replay, output): records fn (a forward pass over static buffers, returning its output tensor);
# each replay recomputes that output in place from the buffers' current values.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


# RoPE types whose tables transformers recomputes when a step's positions pass what it has cached: it reads the
# largest position on the host (a sync, which a capture cannot hold), and a graph would replay stale tables.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def graphs_unsupported(hf_config) -> str | None:
    """Why steps of this model cannot be CUDA graphs; None when they can."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if any(kind in str(rope_type) for kind in _DYNAMIC_ROPE_TYPES):
        return f"RoPE type {rope_type!r} recomputes its tables from the positions on the host"
    return None


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts of graphs of steps with prompt tokens: batch_buckets' up to 1024, then every 256 up to
    max_tokens (a step of 1100 tokens must not be padded to 8192)."""
    small = batch_buckets(min(max_tokens, 1024))
    return small + [s for s in range(1024 + 256, max_tokens, 256)] + ([max_tokens] if max_tokens > 1024 else [])


def blocks_bucket(blocks: int) -> int:
    """`blocks` rounded up to a quarter of an octave (at most a quarter more): few graphs, little extra gather."""
    step = 1 << max(0, blocks.bit_length() - 3)
    return -(-blocks // step) * step


def _bucket(buckets: list[int], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: StepInputs  # the static buffers the graph reads
    output: torch.Tensor  # the static output it writes: logits (decode graphs) or the layers' output (mixed ones)


class CudaCapture:
    """Graphs on one CUDA device, sharing one memory pool (replays never overlap), all captured on one side stream:
    the caching allocator reuses a freed block only on the stream that allocated it, so graphs captured on streams
    of their own would each keep their activations apart, pool or not (as torch.cuda.graph's own default
    capture stream is one for all)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm up on the capture stream (as torch's graph docs ask; cuBLAS keeps a workspace per stream); it writes
        # what the replay will write.
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            output = fn()
        return graph.replay, output


class CudaGraphRunner:
    def __init__(self, eager: ModelRunner, max_num_seqs: int, max_model_len: int, max_graph_tokens: int = 0,
                 capture: Capture | None = None):
        """max_graph_tokens: the most tokens of a step with prompt tokens that a graph holds (0: such steps run
        eagerly); it applies only where varlen attention (either kernel) and the lean forward run."""
        self.eager = eager
        self.device = eager.device
        self.block_size = eager.block_size
        self.kv_cache = eager.kv_cache
        self.batch_buckets = batch_buckets(max_num_seqs)
        max_blocks = -(-min(max_model_len, MAX_GRAPH_CONTEXT) // self.block_size)
        smallest = min(max_blocks, -(-MIN_GRAPH_CONTEXT // self.block_size))
        self.block_buckets = [smallest << i for i in range(max_blocks.bit_length()) if smallest << i < max_blocks]
        self.block_buckets.append(max_blocks)
        mixed = max_graph_tokens > 0 and eager.varlen and eager.lean_model is not None
        self.token_buckets = token_buckets(max_graph_tokens) if mixed else []
        self.run_buckets = batch_buckets(max_num_seqs + 1)  # a mixed step's runs, and one of padding
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._capture_fn = capture or CudaCapture(self.device)
        self._num_mixed = 0
        # The layers' output of every graph of a step with prompt tokens, one buffer for all (a step reads it
        # before the next replays): per graph it would be up to 8 MB (Llama-3.1-8B, 1024 tokens).
        self._hidden: torch.Tensor | None = None
        if self.token_buckets:
            embed = eager.lean_model.embed
            self._hidden = embed.new_empty(self.token_buckets[-1], embed.shape[1])

    def capture_common(self) -> None:
        """Capture every batch size for the shortest contexts (START_UP_BLOCK_BUCKETS) now, so serving starts
        without capture pauses; longer contexts, and steps with prompt tokens, are captured when first seen.
        Largest first, so the smaller reuse its memory pool."""
        started = time.monotonic()
        for blocks in reversed(self.block_buckets[:START_UP_BLOCK_BUCKETS]):
            for batch in reversed(self.batch_buckets):
                padding = DecodePadding(batch, blocks, self.kv_cache.scratch_block)
                example = build_step_inputs([], self.block_size, self.device, padding, self.eager.varlen)
                self._graphs[(batch, blocks)] = self._capture(example)
        log.info("captured %d CUDA graphs in %.1f s%s", len(self._graphs), time.monotonic() - started,
                 f"; steps with prompt tokens get theirs when first seen (up to {self.token_buckets[-1]} tokens)"
                 if self.token_buckets else "")

    @property
    def model(self):
        return self.eager.model

    def prepare(self, entries: list[tuple[Sequence, int]]) -> StepInputs:
        padding = self._padding(entries)
        if padding is None:
            return self.eager.prepare(entries)
        return build_step_inputs(entries, self.block_size, self.device, padding, self.eager.varlen)

    def _padding(self, entries) -> DecodePadding | MixedPadding | None:
        if not entries:
            return None
        return self._decode_padding(entries) or self._mixed_padding(entries)

    def _decode_padding(self, entries) -> DecodePadding | None:
        if entries[-1][1] != 1 or len(entries) > self.batch_buckets[-1]:
            return None  # some prefill in the batch, or too many rows
        context = 0
        for seq, _ in entries:
            length = seq.num_computed_tokens + 1
            if length != len(seq.token_ids):
                # A one-token chunk of a prompt, not a decode: a decode graph samples every row, and this row is
                # not to be sampled (it may owe prompt logprobs instead).
                return None
            if length > context:
                context = length
        ctx_blocks = -(-context // self.block_size)
        if ctx_blocks > self.block_buckets[-1]:
            return None
        return DecodePadding(_bucket(self.batch_buckets, len(entries)), _bucket(self.block_buckets, ctx_blocks),
                             self.kv_cache.scratch_block)

    def _mixed_padding(self, entries) -> MixedPadding | None:
        runs = len(entries)
        if not self.token_buckets or runs >= self.run_buckets[-1]:
            return None
        size = self.block_size
        tokens = blocks = longest = 0
        for seq, n in entries:
            tokens += n
            seq_blocks = -(-(seq.num_computed_tokens + n) // size)
            blocks += seq_blocks
            longest = max(longest, seq_blocks)
        if entries[-1][1] == 1 and longest > self.block_buckets[-1]:
            return None  # a decode-only step past MAX_GRAPH_CONTEXT: eager, as decode graphs leave it
        # At least 2 tokens: the graph's max_q is its token count, and with max_q 1 flash takes its decode path,
        # which needs exactly one query per run (a padding run has none).
        tokens = max(tokens, 2)
        if tokens > self.token_buckets[-1]:
            return None
        padded_runs = _bucket(self.run_buckets, runs + 1)
        padding = MixedPadding(_bucket(self.token_buckets, tokens), padded_runs,
                               blocks_bucket(blocks + padded_runs - runs), self.kv_cache.scratch_block)
        if self._num_mixed >= MAX_MIXED_GRAPHS and (padding.tokens, padding.runs, padding.blocks) not in self._graphs:
            return None
        return padding

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        shape = inputs.graph_shape
        if shape is None:
            return self.eager.forward(inputs)
        graph = self._graphs.get(shape)
        if graph is None:
            try:
                graph = self._capture(inputs)
            except Exception:
                if not _is_mixed(inputs):
                    raise
                # A new kind of graph that this GPU or torch build cannot capture must not take the engine down:
                # such steps run eagerly from now on (a padded step is a valid eager step too).
                log.exception("capturing a CUDA graph of a step with prompt tokens failed; such steps run eagerly "
                              "from now on (--cuda-graph-max-tokens 0 does so from the start)")
                self.token_buckets = []
                return self.eager.forward(inputs)
            self._graphs[shape] = graph
        for static, new in zip(_device_tensors(graph.inputs), _device_tensors(inputs)):
            static.copy_(new, non_blocking=True)
        graph.replay()
        if _is_mixed(inputs):
            return self.eager.logits(graph.output, inputs.sample_rows)
        return graph.output[: len(inputs.sample_seqs)]

    def _capture(self, example: StepInputs) -> _Graph:
        started = time.monotonic()
        # The graph's own copies of the inputs: every replay copies the step's values into them.
        static = copy.deepcopy(dataclasses.replace(example, sample_seqs=[], prompt_runs=[]))
        if _is_mixed(example):
            self._num_mixed += 1
            if self._num_mixed == MAX_MIXED_GRAPHS:
                log.info("%d CUDA graphs of steps with prompt tokens captured, the most kept: steps of other "
                         "shapes run eagerly from now on", MAX_MIXED_GRAPHS)
            hidden = self._hidden
            assert hidden is not None  # token_buckets is not empty

            def layers() -> torch.Tensor:
                out = self.eager.hidden(static)
                return hidden[: out.shape[0]].copy_(out)

            replay, output = self._capture_fn(layers)
        else:
            replay, output = self._capture_fn(lambda: self.eager.forward(static))  # the lean forward, or transformers'
        log.debug("captured a CUDA graph for shape %s in %.2f s", example.graph_shape, time.monotonic() - started)
        return _Graph(replay, static, output)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes captured so far (see StepInputs.graph_shape)."""
        return list(self._graphs)


def _is_mixed(inputs: StepInputs) -> bool:
    """A graph of a step's layers, shaped (tokens, runs, blocks) (see StepInputs.graph_shape)."""
    return inputs.graph_shape is not None and len(inputs.graph_shape) == 3


def _device_tensors(inputs: StepInputs) -> list[torch.Tensor]:
    """The tensors a graph reads that change from step to step, in a fixed order."""
    a = inputs.attention
    tensors = [inputs.input_ids, inputs.positions, a.slot_mapping]
    if a.varlen is None:
        return tensors + [a.decode_blocks, a.decode_mask]
    tensors += [a.varlen.kv_blocks, a.varlen.seqused_k]
    if _is_mixed(inputs):
        return tensors + [a.varlen.cu_q, a.varlen.cu_k]
    # A decode graph's cu_q and cu_k are its bucket's shape (one query and `blocks` whole blocks per row): the
    # graph's own copies already hold them.
    return tensors
