"""Load the model the user asked for onto the device the engine runs on.

`--device auto` means CUDA when present, else the CPU; `--dtype auto` means float32 on the CPU (bfloat16 matmuls
are slow there and the model is small) and bfloat16 on CUDA. `--load-format dummy`: random weights built on the
device from config.json (enginecore.dummy_model), no weights read.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from enginecore.engine_base import BadEngineSetting
from enginecore.model_source import ModelSourceError, check_tokenizer_files, dummy_model_dir, resolve_model

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    hf_config: object
    generation_config: object | None


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadEngineSetting(f"--device {spec}: CUDA is not available on this machine")
        device = torch.device(spec if ":" in spec else "cuda:0")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BadEngineSetting(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
        return device
    if spec == "cpu":
        return torch.device("cpu")
    raise BadEngineSetting(f"--device {spec}: expected auto, cpu, cuda or cuda:N")


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = _DTYPES.get(spec.lower())
    if dtype is None:
        raise BadEngineSetting(f"--dtype {spec}: expected auto, float32, bfloat16 or float16")
    return dtype


def load_model(model_spec: str | None, device_spec: str = "auto", dtype_spec: str = "auto",
               attn_implementation: str = "sdpa", load_format: str = "auto") -> LoadedModel:
    """Raises ModelSourceError (the user's --model) or BadEngineSetting (--device/--dtype/--load-format)."""
    from transformers import AutoConfig, GenerationConfig

    if load_format not in LOAD_FORMATS:
        raise BadEngineSetting(f"--load-format {load_format}: expected {' or '.join(LOAD_FORMATS)}")
    device = pick_device(device_spec)
    dtype = pick_dtype(dtype_spec, device)
    started = time.monotonic()
    log.info("resolving model %s", model_spec or "(embedded SmolLM2-135M-Instruct)")
    model_dir = resolve_model(model_spec)
    if load_format == "dummy":
        model_dir = dummy_model_dir(model_dir)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:
        raise ModelSourceError(f"cannot read the model config in {model_dir}: {exc}") from exc
    check_tokenizer_files(model_dir)
    log.info("loading %s (%s) on %s as %s%s", model_dir, hf_config.model_type, device, str(dtype).removeprefix("torch."),
             ", random weights (--load-format dummy)" if load_format == "dummy" else "")
    from safetensors import SafetensorError  # (transformers' own dependency)

    try:
        model = _build(model_dir, hf_config, device, dtype, attn_implementation, load_format)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"cannot load {model_dir} as a causal language model: {exc}") from exc
    except SafetensorError as exc:  # a truncated or corrupt weights file: say which files were read
        files = ", ".join(sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")))
        raise ModelSourceError(f"cannot load {model_dir} as a causal language model: its weights ({files}) cannot "
                               f"be read, truncated or corrupt: {exc}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the model has no sampling defaults
        generation_config = None
    num_params = sum(p.numel() for p in model.parameters())
    log.info("model loaded in %.1f s (%.0fM parameters)", time.monotonic() - started, num_params / 1e6)
    return LoadedModel(model, model_dir, device, dtype, hf_config, generation_config)


def _build(model_dir, hf_config, device, dtype, attn_implementation, load_format) -> torch.nn.Module:
    if load_format == "dummy":
        from enginecore.dummy_model import build_dummy_model

        return build_dummy_model(hf_config, device, dtype, attn_implementation)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
