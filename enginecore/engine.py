"""EngineCore: requests in, one step at a time, token outputs out. No sockets here (enginecore.serve_loop adds
them), so tests and benchmarks drive it in-process:

    core = EngineCore(ServeConfig(...))          # loads the model, sizes the KV cache
    core.add_request(EngineRequest("r1", prompt_ids, SamplingParams(max_tokens=16, temperature=0)))
    while core.has_work():
        for client, output in core.step(): ...   # RequestOutput deltas, client as given to add_request

A step: schedule -> pack the batch -> one forward pass -> the structured-output mask of its constrained rows
(enginecore.structured_output) -> sample -> append, check for the finish, report. The request bookkeeping (keys,
choices, grammars' matchers, abort, finish) is enginecore.engine_base's, shared with the simulated engine.

Asynchronous scheduling (on for CUDA by default): a step is launched (`_launch`: scheduled, packed, forward pass
and sampling queued on the device, a placeholder -1-row appended to each sampled sequence's tokens) and resolved
later (`_resolve`: the tokens copied back, put in place of their placeholders, finishes checked, reported). With
it, step() launches step k+1 before it resolves step k, so the host's work overlaps the device's: the next step's
rows read their pending input tokens where step k sampled them, on the device. A sequence that step k finishes
has one wasted row in step k+1; a step whose rows need the host's tokens first (a grammar's mask, a penalty, rows
sampled one by one) is resolved before the next launch. Without it, step() launches and resolves the same step.

A request whose row the sampler cannot sample fails alone (an 'error' output for each of its choices); a failing
forward pass is fatal (the KV cache may be half written), as in vLLM.

Prompt logprobs (SamplingParams.prompt_logprobs): such a sequence skips the prefix cache and keeps the logits of
every prompt row of its prefill chunks; their logprobs gather on the sequence across chunks and go out once, in
the RequestOutput of its first output token (choice 0's only when n > 1). With max_tokens 0 that output carries
no token: the prompt is computed for its logprobs only (echo with max_tokens 0).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from enginecore import attention_plan, model_facts
from enginecore.block_pool import KVBlockPool
from enginecore.cpu_setup import prepare_cpu_model, resolve_quantization
from enginecore.cpu_threads import ThreadGovernor, set_cpu_threads
from enginecore.engine_base import BadEngineSetting, EngineBase, EngineLoad
from enginecore.host_to_device import to_device
from enginecore.lean_model import device_lean_model
from enginecore.kv_cache import KVCache, KVShape, cpu_num_blocks
from enginecore.loader import LoadedModel, load_model
from enginecore.model_runner import ModelRunner
from enginecore.sampler import SampledTokens, SampleResult, Sampler, prompt_logprobs
from enginecore.scheduler import Scheduler
from enginecore.sequence import Sequence, SequenceStatus
from enginecore.structured_output import StructuredOutputs
from ipc.config import ServeConfig
from ipc.messages import RequestOutput
from ipc.model_info import ModelInfo

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step whose forward pass and sampling are queued on the device."""

    entries: list[tuple[Sequence, int]]  # the scheduled batch, and choices forked in it: (sequence, tokens computed)
    seqs: list[Sequence]  # one per sampled row (a forked choice shares its parent's row)
    positions: list[int | None]  # where each row's token goes in its token_ids; None: no token (max_tokens 0)
    sampled: SampledTokens | SampleResult
    needs_host_tokens: bool  # resolve before the next launch (a grammar, a penalty, or rows sampled one by one)


def _read_pending_tokens(input_ids: torch.Tensor, pending_tokens: torch.Tensor) -> None:
    """Input ids -1 - r (a token not on the host yet) become row r of the step before's sampled tokens, on the
    device: no wait for that step."""
    waiting = input_ids < 0
    rows = (-1 - input_ids).clamp_(min=0)
    input_ids.copy_(torch.where(waiting, pending_tokens[rows], input_ids))


class EngineCore(EngineBase):
    def __init__(self, config: ServeConfig, loaded: LoadedModel | None = None):
        if config.scheduling_policy not in ("fcfs", "priority"):
            raise BadEngineSetting(f"--scheduling-policy {config.scheduling_policy}: expected fcfs or priority")
        if config.block_size < 1 or config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise BadEngineSetting("block size, max-num-seqs and max-num-batched-tokens must be positive")
        self.config = config
        if loaded is None:
            loaded = load_model(config.model, config.device, config.dtype, load_format=config.load_format)
        self.quantization = resolve_quantization(config.quantization, config.model, loaded.device, loaded.dtype)
        self.thread_governor = None
        if loaded.device.type == "cpu":
            set_cpu_threads()
            self.thread_governor = ThreadGovernor.for_this_machine()
            lean_model = prepare_cpu_model(loaded.model, loaded.dtype, self.quantization)
        else:
            # This process's GPU becomes the current device: what launches on the current device rather than on its
            # tensors' (Triton's kernels, CUDA events) must run there, also for a data-parallel rank on cuda:1+.
            torch.cuda.set_device(loaded.device)
            lean_model = device_lean_model(loaded.model)
        self.quantization = getattr(lean_model, "quantization", None) or self.quantization.replace("auto", "none")
        self.loaded = loaded
        self.device = loaded.device
        self.block_size = config.block_size
        torch.manual_seed(config.seed)

        context_len = model_facts.model_context_len(loaded.hf_config)
        max_len = config.max_model_len or context_len or 2048
        if context_len and max_len > context_len:
            raise BadEngineSetting(f"--max-model-len {max_len} exceeds the model's context of {context_len} tokens")

        self.runner = ModelRunner(loaded.model, self.device, config.block_size, lean_model=lean_model,
                                  attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs)
        if lean_model is not None and self.runner.varlen:  # CUDA, half precision
            lean_model.rope_store = attention_plan.plan_rope_store(self.device, loaded.dtype, lean_model.heads,
                                                                   lean_model.kv_heads, lean_model.head_dim)
        shape = KVShape.of(loaded.hf_config)
        num_blocks = self._num_kv_blocks(shape, max_len)
        # A sequence must fit in the whole pool, else it could never run (and never finish).
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        if self.max_model_len < max_len:
            log.warning("max model length capped to %d tokens: the KV cache holds no more", self.max_model_len)
        self.kv_cache = KVCache(shape, num_blocks, config.block_size, loaded.dtype, self.device)
        self.runner.kv_cache = self.kv_cache
        if self.device.type == "cuda" and not config.enforce_eager:
            self._use_cuda_graphs(config, loaded.hf_config)

        self.pool = KVBlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_tokens)
        super().__init__(self.max_model_len, loaded.model.get_output_embeddings().weight.shape[0],
                         model_facts.eos_token_ids(loaded.hf_config, loaded.generation_config),
                         use_priority=config.scheduling_policy == "priority")
        self.sampler = Sampler(self.vocab_size, self.device, self.eos_token_ids, config.seed)
        # Asynchronous scheduling: the host schedules and prepares step k+1 while the device computes step k.
        # On by default where a device computes beside the host (CUDA); on the CPU the forward pass is the host's
        # own work, so there it would only delay each token by a step.
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self.pending: _Launched | None = None
        self.structured = StructuredOutputs(os.path.join(loaded.model_dir, "tokenizer.json"), self.vocab_size,
                                            self.eos_token_ids, config.grammar_cache_size)
        self.grammar_compiler = self.structured.compiler
        self.model_info = ModelInfo(
            model_dir=loaded.model_dir,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            generation_defaults=model_facts.generation_defaults(loaded.model_dir),
            device=str(self.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
        )

    def _use_cuda_graphs(self, config: ServeConfig, hf_config) -> None:
        """Steps replayed from CUDA graphs, the common ones captured now; eager where the model's steps cannot be."""
        from enginecore.cuda_graphs import CudaGraphRunner, graphs_unsupported

        why_not = graphs_unsupported(hf_config)
        if why_not:
            log.warning("no CUDA graphs: %s; every step runs eagerly", why_not)
            return
        self.runner = CudaGraphRunner(self.runner, config.max_num_seqs, self.max_model_len,
                                      min(config.cuda_graph_max_tokens, config.max_num_batched_tokens))
        self.runner.capture_common()

    def _num_kv_blocks(self, shape: KVShape, max_len: int) -> int:
        config = self.config
        per_block = shape.bytes_per_block(config.block_size, self.loaded.dtype)
        if self.device.type == "cuda":
            from enginecore.cuda_setup import size_cuda_kv_cache

            num_blocks = size_cuda_kv_cache(self.runner, shape, config, per_block, self.loaded.dtype)
        else:
            num_blocks = cpu_num_blocks(per_block, config.block_size, max_len, config.max_num_seqs,
                                        config.kv_cache_memory)
        if num_blocks < 2:
            raise BadEngineSetting(f"the KV cache has room for {num_blocks} blocks only: give it more memory")
        return num_blocks

    # --- how this engine schedules and makes tokens (the rest is EngineBase's) ---------------------------------
    def _schedule(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def _start_fork(self, parent: Sequence, child: Sequence) -> bool:
        if child.grammar is not None:
            self.structured.forked(child)
        if self.scheduler.full():  # --max-num-seqs holds for forks too: n=128 once ran 128 sequences a step
            self.scheduler.add_fork(child)
            return False
        self.pool.fork(parent, child)
        self.scheduler.add_running(child)
        return True

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(generator_seed(seed, self.device))

    def _constrain(self, seq: Sequence) -> str | None:
        return self.structured.start(seq)

    def has_work(self) -> bool:
        return self.pending is not None or self.scheduler.has_work()

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.scheduler.running), self.scheduler.num_waiting, self.pool.usage)

    # --- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[bytes | None, RequestOutput]]:
        """Run one batch: (client, output) for each sequence that got a token or failed. Under asynchronous
        scheduling the outputs are those of the step before: this step's are still being computed."""
        if self.thread_governor is not None:
            self.thread_governor.tick()
        outputs = []
        pending, self.pending = self.pending, None
        if pending is not None and pending.needs_host_tokens:
            outputs += self._resolve(pending)  # a grammar or a penalty needs its tokens before the next step
            pending = None
        launched = self._launch(pending)
        if pending is not None:
            outputs += self._resolve(pending)
        if launched is not None:
            self._account(launched)
            if self.async_scheduling:
                self.pending = launched
            else:
                outputs += self._resolve(launched)
        return outputs

    def _launch(self, pending: _Launched | None) -> _Launched | None:
        """Schedule a batch and queue its forward pass and sampling. A token still pending from the step before
        is read on the device, where that step sampled it (its place in token_ids holds -1 - its row)."""
        batch = self.scheduler.schedule()
        if not batch:
            return None
        inputs = self.runner.prepare(batch.entries)
        counts = self.step_counts
        counts.steps += 1
        if inputs.graph_shape is not None:
            counts.graph_steps += 1
        if batch.entries[-1][1] > 1:  # prompt chunks of more than one token come last
            counts.prompt_steps += 1
            counts.prompt_tokens += sum(n for _, n in batch.entries if n > 1)
        if pending is not None and pending.seqs:
            _read_pending_tokens(inputs.input_ids, pending.sampled.token_ids)
        self.kv_cache.copy_blocks(batch.block_copies)
        logits = self.runner.forward(inputs)
        if inputs.prompt_runs:
            logits = self._keep_prompt_logprobs(logits, inputs)

        seqs = inputs.sample_seqs
        entries = batch.entries
        if any(seq.pending_forks for seq in seqs):  # a prompt just computed forks its other choices
            seqs, rows = [], []
            entries = list(entries)
            computed_now = dict(batch.entries)
            for row, seq in enumerate(inputs.sample_seqs):
                seqs.append(seq)
                rows.append(row)
                for child in self._fork(seq):
                    seqs.append(child)
                    rows.append(row)
                    # Forked before this step's tokens are counted (_account): counted with its parent's, or it
                    # would compute its whole prompt again next step, into blocks of its own (n=128: 127 times).
                    entries.append((child, computed_now[seq]))
            if len(rows) != len(inputs.sample_seqs):
                logits = logits[to_device(rows, logits.device)]
        allowed = self.structured.mask(seqs)
        sampled: SampledTokens | SampleResult
        try:
            sampled = self.sampler.launch(logits, seqs, allowed)
        except Exception:
            log.exception("sampling %d rows at once failed: sampling them one by one", len(seqs))
            sampled = self.sampler.sample_each(logits, seqs, allowed)
        positions: list[int | None] = []
        needs_host_tokens = False
        for row, seq in enumerate(seqs):
            sampling = seq.sampling
            if seq.grammar is not None or sampling.penalized:
                needs_host_tokens = True
            if sampling.max_tokens == 0:  # the prompt's logprobs only: no token
                positions.append(None)
                continue
            token_ids = seq.token_ids
            positions.append(len(token_ids))
            token_ids.append(-1 - row)  # a placeholder until the token is on the host
        # Rows sampled one by one have their tokens on the host already, not where the next step would read them.
        needs_host_tokens = needs_host_tokens or isinstance(sampled, SampleResult)
        return _Launched(entries, seqs, positions, sampled, needs_host_tokens)

    def _account(self, launched: _Launched) -> None:
        """The step's tokens are in the cache: count them, and offer the blocks they filled to the prefix cache."""
        pool = self.pool
        block_size = pool.block_size
        caching = pool.enable_prefix_caching
        finished = SequenceStatus.FINISHED
        for seq, n in launched.entries:
            if seq.status is not finished:
                computed = seq.num_computed_tokens = seq.num_computed_tokens + n
                # A block fills every block_size tokens: only then has the pool something to register.
                if caching and computed // block_size > seq.num_registered_blocks:
                    pool.register_full_blocks(seq)

    def _resolve(self, launched: _Launched) -> list[tuple[bytes | None, RequestOutput]]:
        """Wait for a launched step's tokens and report them."""
        result = launched.sampled if isinstance(launched.sampled, SampleResult) else launched.sampled.result()
        outputs = []
        for seq, error in zip(launched.seqs, result.errors or ()):
            key = (seq.client, seq.request_id)
            if error is not None and key in self.requests:
                outputs += self.fail_request(key, error)
        emit, finished = self._emit, SequenceStatus.FINISHED
        for seq, position, token, logprobs in zip(launched.seqs, launched.positions, result.token_ids,
                                                  result.logprobs):
            if seq.status is not finished:  # else it finished (or failed, or was aborted) after this step was launched
                outputs.append(emit(seq, token, logprobs, position))
        return outputs

    @staticmethod
    def _keep_prompt_logprobs(logits: torch.Tensor, inputs) -> torch.Tensor:
        """Gather the logprobs of the step's prompt rows on their sequences; the sampled rows' logits back."""
        k = len(inputs.sample_seqs)
        tokens, tops = [], []
        for seq, first, count in inputs.prompt_runs:
            tokens += seq.token_ids[first + 1:first + 1 + count]
            tops += [seq.sampling.prompt_logprobs] * count
        entries = prompt_logprobs(logits[k:], tokens, tops)
        at = 0
        for seq, first, count in inputs.prompt_runs:
            seq.pending_prompt_logprobs.extend(entries[at:at + count])
            seq.num_prompt_logprobs = first + count
            at += count
        return logits[:k]

    # --- utilities ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            **super().stats(),
            "num_kv_blocks": self.pool.num_blocks,
            "num_free_kv_blocks": self.pool.num_free,
        }

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


def generator_seed(seed: int, device: torch.device) -> int:
    """A request's 64-bit seed (the API takes -2**63 to 2**63-1) as its generator's seed. torch's CPU generator
    keeps the low 32 bits only, so s and s + 2**32 drew alike, and -1 as 2**64-1: there a seed outside 0 to
    2**32-1 is hashed to 32 bits (Fibonacci hashing: collisions no longer follow a pattern), and one inside is
    kept, so the draws of the seeds clients use most stay what they were. CUDA's generator takes all 64 bits."""
    if device.type != "cpu" or 0 <= seed < 2**32:
        return seed
    return ((seed % 2**64) * 0x9E3779B97F4A7C15 % 2**64) >> 32
