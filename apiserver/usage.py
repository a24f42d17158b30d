"""The `usage` object: the prompt counted once per prompt (not once per choice), every choice's tokens."""
from __future__ import annotations

from apiserver.generation import Generation
from ipc.config import ServeConfig


def usage(generation: Generation, config: ServeConfig) -> dict:
    prompt = generation.num_prompt_tokens
    completion = generation.num_completion_tokens
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if config.enable_prompt_tokens_details:
        out["prompt_tokens_details"] = {"cached_tokens": generation.num_cached_tokens}
    return out
