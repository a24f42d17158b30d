"""What an engine core tells the supervisor when it is READY (or why it could not start), and what the
supervisor hands on to every API server: where the tokenizer lives and the limits of the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str  # a local directory holding the tokenizer, its chat template and generation_config.json
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # Sampling defaults from the model's generation_config.json (temperature, top_p, top_k, ...).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = "float32"
    num_kv_blocks: int = 0
    block_size: int = 16


@dataclass(frozen=True)
class EngineReady:
    rank: int
    model: ModelInfo
    address: str = ""  # where its ROUTER listens (the port a `*` bind got)


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not start. `user_error`: the user's input was at fault (exit 2, one line, no traceback)."""

    rank: int
    message: str
    user_error: bool = False
