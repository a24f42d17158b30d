"""EngineCore: requests in, one step at a time, token outputs out. No sockets here (enginecore.process adds them),
so tests and benchmarks drive it in-process:

    core = EngineCore(ServeConfig(...))          # loads the model, sizes the KV cache
    core.add_request(EngineRequest("r1", prompt_ids, SamplingParams(max_tokens=16, temperature=0)))
    while core.has_work():
        for client, output in core.step(): ...   # RequestOutput deltas, client as given to add_request

A step: schedule -> pack the batch -> one forward pass -> sample -> append, check for the finish, report.

Prompt logprobs (SamplingParams.prompt_logprobs): such a sequence skips the prefix cache and keeps the logits of
every prompt row of its prefill chunks; their logprobs gather on the sequence across chunks and go out once, in
the RequestOutput of its first output token (choice 0's only when n > 1). With max_tokens 0 that output carries
no token: the prompt is computed for its logprobs only (echo with max_tokens 0).
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from enginecore import model_facts
from enginecore.block_pool import KVBlockPool
from enginecore.cpu_setup import prepare_cpu_model, resolve_quantization
from enginecore.kv_cache import KVCache, KVShape, cpu_num_blocks
from enginecore.cpu_threads import set_cpu_threads
from enginecore.loader import BadEngineSetting, LoadedModel, load_model
from enginecore.model_runner import ModelRunner
from enginecore.sampler import Sampler, prompt_logprobs
from enginecore.scheduler import Scheduler
from enginecore.sequence import Sequence
from enginecore.structured_output import StructuredOutputs
from ipc.config import ServeConfig
from ipc.messages import EngineRequest, FinishReason, RequestOutput
from ipc.model_info import ModelInfo

log = logging.getLogger(__name__)

RequestKey = tuple  # (client, request_id)


class EngineCore:
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
        self.use_priority = config.scheduling_policy == "priority"
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

        self.pool = KVBlockPool(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
        self.vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = model_facts.eos_token_ids(loaded.hf_config, loaded.generation_config)
        self.sampler = Sampler(self.vocab_size, self.device, self.eos_token_ids, config.seed)
        self.structured = StructuredOutputs(os.path.join(loaded.model_dir, "tokenizer.json"), self.vocab_size,
                                            self.eos_token_ids)
        self.requests: dict[RequestKey, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
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

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest, client: bytes | None = None) -> list[RequestOutput]:
        """Queue a request. Returns outputs at once only for one that cannot run (it is finished right away)."""
        key = (client, request.request_id)
        if key in self.requests:
            log.warning("request %s is already running: ignoring the duplicate", request.request_id)
            return []
        p = request.sampling
        prompt = list(request.prompt_token_ids)
        reason = self._refusal(prompt, p)
        if reason is not None:
            log.warning("request %s finished at once: %s", request.request_id, reason[1])
            return _finished_at_once(request, reason[0])
        if p.max_tokens == 0 and p.prompt_logprobs is None:  # nothing to compute (echo with max_tokens 0)
            return _finished_at_once(request, FinishReason.LENGTH)
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(p.seed)
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=request.request_id, client=client, index=0,
            token_ids=prompt, num_prompt_tokens=len(prompt), sampling=p,
            priority=request.priority if self.use_priority else 0, arrival=next(self._arrivals),
            generator=generator, num_forks_pending=max(1, p.n) - 1,
            pending_prompt_logprobs=None if p.prompt_logprobs is None else [],
        )
        if p.grammar is not None:
            error = self.structured.start(seq)
            if error is not None:
                log.warning("request %s failed: %s", request.request_id, error)
                return _finished_at_once(request, FinishReason.ERROR, error)
        self.requests[key] = [seq]
        self.scheduler.add(seq)
        return []

    def _refusal(self, prompt: list[int], p) -> tuple[str, str] | None:
        if not prompt:
            return FinishReason.ABORT, "empty prompt"
        if len(prompt) >= self.max_model_len:
            return FinishReason.LENGTH, f"prompt of {len(prompt)} tokens, the model allows {self.max_model_len}"
        if p.max_tokens < 0:
            return FinishReason.LENGTH, "max_tokens < 0"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return FinishReason.ABORT, "token id out of the vocabulary"
        return None

    def abort(self, request_ids: list[str], client: bytes | None = None) -> list[RequestOutput]:
        """Finish the requests now and free their blocks; one 'abort' output per unfinished choice."""
        outputs = []
        for request_id in request_ids:
            seqs = self.requests.pop((client, request_id), None)
            if seqs is None:
                continue
            for seq in seqs:
                if not seq.finished:
                    self.scheduler.finish(seq)
                    outputs.append(self._output(seq, [], None, FinishReason.ABORT))
                # Choices not forked yet are aborted too, so the client hears of all n.
                for i in range(seq.num_forks_pending):
                    outputs.append(RequestOutput(request_id, [], len(seqs) + i, FinishReason.ABORT,
                                                 num_prompt_tokens=seq.num_prompt_tokens))
        return outputs

    def abort_client(self, identity: str) -> int:
        """Abort every request of one API server (the supervisor calls this when that server is gone): the count.
        Their abort outputs are dropped: nobody is left to read them."""
        client = identity.encode()
        request_ids = [request_id for owner, request_id in self.requests if owner == client]
        self.abort(request_ids, client)
        return len(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[bytes | None, RequestOutput]]:
        """Run one batch: (client, output) for each sequence that got a token."""
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
            self.scheduler.register_full_blocks(seq)

        seqs, rows = [], []
        for row, seq in enumerate(inputs.sample_seqs):
            seqs.append(seq)
            rows.append(row)
            for child in self._fork(seq):
                seqs.append(child)
                rows.append(row)
        if len(rows) != len(inputs.sample_seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler.sample(logits, seqs, self.structured.mask(seqs))

        outputs = []
        for seq, token, logprobs in zip(seqs, result.token_ids, result.logprobs):
            prompt_lp = seq.pending_prompt_logprobs
            if prompt_lp is not None:
                seq.pending_prompt_logprobs = None
            if seq.sampling.max_tokens == 0:  # the prompt's logprobs only: no token
                new, lp, finish, stop = [], None, FinishReason.LENGTH, None
            elif seq.grammar is not None and not seq.grammar.accept(token):
                outputs.append((seq.client, RequestOutput(seq.request_id, [], seq.index, FinishReason.ERROR,
                                                          num_prompt_tokens=seq.num_prompt_tokens,
                                                          error=seq.grammar.error)))
                self._retire(seq)
                continue
            else:
                seq.token_ids.append(token)
                finish, stop = self._finish_reason(seq, token)
                new, lp = [token], [logprobs] if logprobs is not None else None
            outputs.append((seq.client, self._output(seq, new, lp, finish, stop, prompt_lp)))
            if finish is not None:
                self._retire(seq)
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

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The request's other n-1 choices, sharing every KV block of the computed prompt."""
        if not parent.num_forks_pending:
            return []
        siblings = self.requests[(parent.client, parent.request_id)]
        children = []
        for _ in range(parent.num_forks_pending):
            index = len(siblings)
            generator = None
            if parent.sampling.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(parent.sampling.seed + index)
            child = Sequence(
                seq_id=next(self._seq_ids), request_id=parent.request_id, client=parent.client, index=index,
                token_ids=list(parent.token_ids), num_prompt_tokens=parent.num_prompt_tokens,
                sampling=parent.sampling, priority=parent.priority, arrival=parent.arrival, generator=generator,
                block_table=list(parent.block_table), num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens, block_hashes=list(parent.block_hashes),
                num_registered_blocks=parent.num_registered_blocks, num_prompt_logprobs=parent.num_prompt_logprobs,
                grammar=None if parent.grammar is None else parent.grammar.fork(),
            )
            if child.grammar is not None:
                self.structured.forked(child)
            for block in child.block_table:
                self.pool.share(block)
            self.scheduler.add_running(child)
            siblings.append(child)
            children.append(child)
        parent.num_forks_pending = 0
        return children

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        p = seq.sampling
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP, None
        if seq.grammar is not None and seq.grammar.done:  # the constrained output is complete
            return FinishReason.STOP, None
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        key = (seq.client, seq.request_id)
        siblings = self.requests.get(key)
        if siblings is not None and all(s.finished and not s.num_forks_pending for s in siblings):
            del self.requests[key]

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs, finish: str | None, stop: int | None = None,
                prompt_logprobs: list | None = None):
        return RequestOutput(seq.request_id, tokens, seq.index, finish, stop, seq.num_prompt_tokens,
                             seq.num_cached_tokens, logprobs, prompt_logprobs)

    # --- utilities ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "num_kv_blocks": self.pool.num_blocks,
            "num_free_kv_blocks": self.pool.num_free,
            "kv_cache_usage": self.pool.usage,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_requests": len(self.requests),
        }

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def generate(self, requests: list[EngineRequest]) -> dict[tuple[str, int], list[int]]:
        """Run `requests` to completion (tests and benchmarks): {(request_id, index): output token ids}."""
        tokens: dict[tuple[str, int], list[int]] = {}
        for request in requests:
            for out in self.add_request(request):
                tokens.setdefault((out.request_id, out.index), [])
        while self.has_work():
            for _, out in self.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return tokens


def _finished_at_once(request: EngineRequest, reason: str, error: str | None = None) -> list[RequestOutput]:
    """One finished output, with no token, per choice of a request that runs no step."""
    return [RequestOutput(request.request_id, [], i, reason, num_prompt_tokens=len(request.prompt_token_ids),
                          error=error) for i in range(max(1, request.sampling.n))]
