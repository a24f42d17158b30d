"""EngineCore: requests in, one step at a time, token outputs out. No sockets here (enginecore.serve_loop adds
them), so tests and benchmarks drive it in-process:

    core = EngineCore(ServeConfig(...))          # loads the model, sizes the KV cache
    core.add_request(EngineRequest("r1", prompt_ids, SamplingParams(max_tokens=16, temperature=0)))
    while core.has_work():
        for client, output in core.step(): ...   # RequestOutput deltas, client as given to add_request

A step: schedule -> pack the batch -> one forward pass -> the structured-output mask of its constrained rows
(enginecore.structured_output) -> sample -> append, check for the finish, report. The request bookkeeping (keys,
choices, grammars' matchers, abort, finish) is enginecore.engine_base's, shared with the simulated engine.

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

import torch

from enginecore import model_facts
from enginecore.block_pool import KVBlockPool
from enginecore.cpu_setup import prepare_cpu_model, resolve_quantization
from enginecore.cpu_threads import set_cpu_threads
from enginecore.engine_base import BadEngineSetting, EngineBase, EngineLoad
from enginecore.kv_cache import KVCache, KVShape, cpu_num_blocks
from enginecore.loader import LoadedModel, load_model
from enginecore.model_runner import ModelRunner
from enginecore.sampler import Sampler, prompt_logprobs
from enginecore.scheduler import Scheduler
from enginecore.sequence import Sequence
from enginecore.structured_output import StructuredOutputs
from ipc.config import ServeConfig
from ipc.messages import RequestOutput
from ipc.model_info import ModelInfo

log = logging.getLogger(__name__)


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
        cpu_model = None
        if loaded.device.type == "cpu":
            set_cpu_threads()
            cpu_model = prepare_cpu_model(loaded.model, loaded.dtype, self.quantization)
        self.quantization = getattr(cpu_model, "quantization", None) or self.quantization.replace("auto", "none")
        self.loaded = loaded
        self.device = loaded.device
        self.block_size = config.block_size
        torch.manual_seed(config.seed)

        context_len = model_facts.model_context_len(loaded.hf_config)
        max_len = config.max_model_len or context_len or 2048
        if context_len and max_len > context_len:
            raise BadEngineSetting(f"--max-model-len {max_len} exceeds the model's context of {context_len} tokens")

        self.runner = ModelRunner(loaded.model, self.device, config.block_size, cpu_model=cpu_model)
        shape = KVShape.of(loaded.hf_config)
        num_blocks = self._num_kv_blocks(shape, max_len)
        # A sequence must fit in the whole pool, else it could never run (and never finish).
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        if self.max_model_len < max_len:
            log.warning("max model length capped to %d tokens: the KV cache holds no more", self.max_model_len)
        self.kv_cache = KVCache(shape, num_blocks, config.block_size, loaded.dtype, self.device)
        self.runner.kv_cache = self.kv_cache
        if self.device.type == "cuda" and not config.enforce_eager:
            from enginecore.cuda_graphs import CudaGraphRunner

            self.runner = CudaGraphRunner(self.runner, config.max_num_seqs, self.max_model_len)
            self.runner.capture_common()

        self.pool = KVBlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        super().__init__(self.max_model_len, loaded.model.get_output_embeddings().weight.shape[0],
                         model_facts.eos_token_ids(loaded.hf_config, loaded.generation_config),
                         use_priority=config.scheduling_policy == "priority")
        self.sampler = Sampler(self.vocab_size, self.device, self.eos_token_ids, config.seed)
        self.structured = StructuredOutputs(os.path.join(loaded.model_dir, "tokenizer.json"), self.vocab_size,
                                            self.eos_token_ids)
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

    def _start_fork(self, parent: Sequence, child: Sequence) -> None:
        self.pool.fork(parent, child)
        self.scheduler.add_running(child)
        if child.grammar is not None:
            self.structured.forked(child)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _constrain(self, seq: Sequence) -> str | None:
        return self.structured.start(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.scheduler.running), self.scheduler.num_waiting, self.pool.usage)

    # --- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[bytes | None, RequestOutput]]:
        """Run one batch: (client, output) for each sequence that got a token or failed."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        inputs = self.runner.prepare(batch.entries)
        self.kv_cache.copy_blocks(batch.block_copies)
        logits = self.runner.forward(inputs)
        if inputs.prompt_runs:
            logits = self._keep_prompt_logprobs(logits, inputs)
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.pool.register_full_blocks(seq)

        seqs, rows = [], []
        for row, seq in enumerate(inputs.sample_seqs):
            seqs.append(seq)
            rows.append(row)
            for child in self._fork(seq):
                seqs.append(child)
                rows.append(row)
        if len(rows) != len(inputs.sample_seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        allowed = self.structured.mask(seqs)
        try:
            result = self.sampler.sample(logits, seqs, allowed)
        except Exception:
            log.exception("sampling %d rows at once failed: sampling them one by one", len(seqs))
            result = self.sampler.sample_each(logits, seqs, allowed)

        outputs = []
        for seq, error in zip(seqs, result.errors or ()):
            key = (seq.client, seq.request_id)
            if error is not None and key in self.requests:
                outputs += self.fail_request(key, error)
        for seq, token, logprobs in zip(seqs, result.token_ids, result.logprobs):
            if not seq.finished:  # else its request just failed
                outputs.append(self._emit(seq, token, logprobs))
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
