"""How many KV blocks fit on the GPU: measure the activations of the largest step, give the KV cache the rest of
--gpu-memory-utilization. Only imported on CUDA."""
from __future__ import annotations

import logging

import torch

from enginecore.kv_cache import KVCache, KVShape, cuda_num_blocks
from enginecore.model_runner import ModelRunner
from enginecore.sequence import Sequence
from ipc.config import ServeConfig
from ipc.sampling import SamplingParams

log = logging.getLogger(__name__)

# Room kept for CUDA graphs (their private memory pool) and allocator fragmentation.
GRAPH_AND_SLACK_BYTES = 512 * 2**20


def size_cuda_kv_cache(runner: ModelRunner, shape: KVShape, config: ServeConfig, bytes_per_block: int,
                       dtype: torch.dtype) -> int:
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    peak = _profile_step(runner, shape, config, dtype)
    # The sampler's float32 copies of the logits (a handful of [rows, vocab] tensors at most).
    vocab = runner.model.get_output_embeddings().weight.shape[0]
    sampler_bytes = 4 * config.max_num_seqs * vocab * 4
    mixed_graphs = (not config.enforce_eager and config.cuda_graph_max_tokens > 0 and runner.varlen
                    and runner.lean_model is not None)
    graph_tokens = min(config.cuda_graph_max_tokens, config.max_num_batched_tokens) if mixed_graphs else 0
    activations = reserved_bytes(max(0, peak - before), sampler_bytes, graph_tokens, config.max_num_batched_tokens)
    log.info("profiling step of %d tokens: %.2f GiB of activations, CUDA graphs and slack", config.max_num_batched_tokens,
             activations / 2**30)
    return cuda_num_blocks(device, bytes_per_block, config.gpu_memory_utilization, activations)


def reserved_bytes(step_bytes: int, sampler_bytes: int, graph_tokens: int, step_tokens: int) -> int:
    """What the KV cache must leave free: the largest step's activations (`step_bytes`, measured for `step_tokens`
    tokens), the sampler's copies, slack, and the CUDA graphs' private pool. That pool holds the activations of the
    largest graph: those of a step of `graph_tokens` tokens with prompt tokens (about that share of the largest
    step's: activations grow with the tokens), within the fixed allowance for decode graphs."""
    graph_pool = step_bytes * graph_tokens // step_tokens if graph_tokens else 0
    return step_bytes + sampler_bytes + max(GRAPH_AND_SLACK_BYTES, graph_pool + GRAPH_AND_SLACK_BYTES // 2)


@torch.inference_mode()
def _profile_step(runner: ModelRunner, shape: KVShape, config: ServeConfig, dtype: torch.dtype) -> int:
    """Run one prefill of max_num_batched_tokens tokens on a throwaway cache; the peak memory it reached, less that
    cache (allocated after the caller's `before`, and not the step's activations)."""
    tokens = config.max_num_batched_tokens
    blocks = -(-tokens // config.block_size)
    cache = KVCache(shape, blocks, config.block_size, dtype, runner.device)
    seq = Sequence(seq_id=-1, request_id="profile", client=None, index=0, token_ids=[0] * tokens,
                   num_prompt_tokens=tokens, sampling=SamplingParams(), priority=0, arrival=0,
                   block_table=list(range(blocks)))
    saved, runner.kv_cache = runner.kv_cache, cache
    try:
        runner.forward(runner.prepare([(seq, tokens)]))
        torch.cuda.synchronize(runner.device)
        return torch.cuda.max_memory_allocated(runner.device) - cache.tensor.numel() * cache.tensor.element_size()
    finally:
        runner.kv_cache = saved
        del cache
        torch.cuda.empty_cache()
