"""Shared by the engine tests (no tests here): the embedded model loaded once per session, engines built on it,
and plain transformers greedy generation as the reference."""
from __future__ import annotations

import functools

import enginecore  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads)
import pytest
import torch
from enginecore.engine import EngineCore
from enginecore.loader import LoadedModel, load_model
from ipc.config import ServeConfig
from ipc.messages import EngineRequest
from ipc.sampling import SamplingParams

# Chat prompts of quite different lengths (a few tokens to a few hundred), so batches mix short and long runs.
QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name. " * 3,
    "List five prime numbers. " + "Here is some context you may ignore: the quick brown fox jumps over it. " * 12,
]


@functools.lru_cache(maxsize=1)
def loaded_model() -> LoadedModel:
    return load_model(None, "cpu", "float32")


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(loaded_model().model_dir)


def chat_prompt(question: str) -> list[int]:
    ids = tokenizer().apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def make_engine(**overrides) -> EngineCore:
    # Float32 weights: these engines are compared with plain transformers token for token.
    settings = dict(device="cpu", dtype="float32", quantization="none", kv_cache_memory=64 * 2**20,
                    max_model_len=2048)
    settings.update(overrides)
    return EngineCore(ServeConfig(**settings), loaded=loaded_model())


def engine_block_bytes() -> int:
    """The bytes of one KV block of the embedded model (16 tokens), to size a deliberately small pool."""
    from enginecore.kv_cache import KVShape

    loaded = loaded_model()
    return KVShape.of(loaded.hf_config).bytes_per_block(16, loaded.dtype)


def record_preemptions(engine: EngineCore) -> list[str]:
    """The request ids the engine's scheduler preempts from now on, in order (the list fills as it runs)."""
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def recording(seq):
        preempted.append(seq.request_id)
        preempt(seq)

    engine.scheduler._preempt = recording
    return preempted


def run_outputs(engine: EngineCore, requests: list[EngineRequest]) -> dict[tuple[str, int], list]:
    """Run `requests` to completion: every output of every choice, in order, by (request_id, index)."""
    outputs: dict[tuple[str, int], list] = {}
    for request in requests:
        for out in engine.add_request(request):
            outputs.setdefault((out.request_id, out.index), []).append(out)
    while engine.has_work():
        for _, out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    return outputs


def greedy_request(request_id: str, prompt: list[int], max_tokens: int, **sampling) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model = loaded_model().model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        model.set_attn_implementation(previous)
    return tuple(out[0, len(prompt):].tolist())


def reference_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    """Plain transformers `generate(do_sample=False)`, one prompt at a time, stopping at EOS like the engine."""
    return list(_reference(tuple(prompt), max_tokens))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return [chat_prompt(q) for q in QUESTIONS]
