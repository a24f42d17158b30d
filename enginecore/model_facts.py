"""What the API servers must know about the model: its stop tokens, its context length, its sampling defaults."""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

# Sampling fields of generation_config.json that the API servers use as defaults under the request's own.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty", "do_sample", "max_new_tokens")


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(hf_config, generation_config) -> tuple[int, ...]:
    """The union of the generation config's and the model config's EOS ids, generation config first."""
    ids: list[int] = []
    for source in (generation_config, hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None,
                   hf_config):
        for i in _as_ids(getattr(source, "eos_token_id", None) if source is not None else None):
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def generation_defaults(model_dir: str) -> dict:
    """Only the fields the model's generation_config.json states, not transformers' built-in defaults."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path) as f:
            stated = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: stated[k] for k in SAMPLING_DEFAULT_KEYS if k in stated and stated[k] is not None}


def model_context_len(hf_config) -> int | None:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
