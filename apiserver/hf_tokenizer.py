"""The model's tokenizer, read from its Hugging Face files with the `tokenizers` library alone.

An API server must not import transformers: where torch is installed with CUDA, transformers pulls it in
and an idle API server holds 585 MB. So this module rebuilds what transformers' PreTrainedTokenizerFast
(TokenizersBackend in transformers 5) makes of the same directory, step for step:
- the Rust tokenizer from tokenizer.json, without its truncation and padding (transformers' `encode` turns
  both off unless asked);
- the added tokens of tokenizer_config.json (`added_tokens_decoder`; tokenizer.json's own, or the legacy
  special_tokens_map.json, when it has none) and the named special tokens (`bos_token`, `eos_token`, ...,
  model-specific `*_token` keys, `extra_special_tokens` / `additional_special_tokens`) added in one
  `add_tokens` call, special tokens marked special; `split_special_tokens` as the tokenizer's switch;
- BOS/EOS come from tokenizer.json's post-processor alone: with a tokenizer.json, transformers drops
  `add_bos_token`/`add_eos_token` from the config;
- decode: the Rust decode, then `clean_up_tokenization_spaces` when the config asks and the model is not BPE;
- chat templates: `chat_template.jinja` and `additional_chat_templates/*.jinja` over the config's
  `chat_template` (a string, or a list of named templates).
A test compares ids, text and rendered chats with transformers' for the embedded model and varied configs.
"""
from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens, in the order it adds them.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_TEMPLATE = "default"


class TokenizerFilesError(ValueError):
    """The directory has no usable tokenizer.json (the API server cannot serve without one)."""


class HFTokenizer:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerFilesError(f"{model_dir} has no tokenizer.json")
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json")) or {}
        self.tokenizer_class: str = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        self.backend = Tokenizer.from_file(path)
        self.backend.no_truncation()
        self.backend.no_padding()
        added = _added_tokens(config, model_dir, path)
        named, extra = _special_tokens(config, added)
        _add_tokens(self.backend, added, named, extra)
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # What chat templates see as variables: every named special token, as text.
        self.special_tokens: dict[str, str] = {name: str(value) for name, value in named.items()}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self.backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )
        self.chat_templates: dict[str, str] = _chat_templates(config, model_dir)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend.get_added_tokens_decoder()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, release_gil: bool = False) -> str:
        """release_gil: decode with `decode_batch`, which lets other threads run meanwhile (`decode` keeps the
        GIL: 4 million ids held an event loop beside the thread for 1 s; ~0.1 s, converting the list, this way)."""
        if release_gil:
            text = self.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def chat_template(self, name: str | None = None) -> str | None:
        """The template `name` names, else the model's default one; None when it has none."""
        if name is not None:
            return self.chat_templates.get(name)
        return self.chat_templates.get(DEFAULT_TEMPLATE)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _added_token(value) -> AddedToken | str:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        fields = {k: v for k, v in value.items() if k not in ("__type", "id")}
        return AddedToken(**fields)
    return value


def _added_tokens(config: dict, model_dir: str, tokenizer_json: str) -> dict[int, AddedToken]:
    """Id -> token: the config's `added_tokens_decoder`, else (legacy) tokenizer.json's own added tokens, with
    special_tokens_map.json merged into `config` as transformers does then."""
    if "added_tokens_decoder" in config:
        return {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    _merge_special_tokens_map(config, model_dir)
    with open(tokenizer_json, encoding="utf-8") as f:
        return {t["id"]: _added_token(t) for t in json.load(f).get("added_tokens", [])}


def _merge_special_tokens_map(config: dict, model_dir: str) -> None:
    for key, value in (_read_json(os.path.join(model_dir, "special_tokens_map.json")) or {}).items():
        if isinstance(value, dict) and key not in ("extra_special_tokens", "additional_special_tokens"):
            value = AddedToken(**{k: v for k, v in value.items() if k not in ("special", "__type")}, special=True)
        elif key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
            existing = list(config.get(key) or [])
            for token in value:
                token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                if token not in existing:
                    existing.append(token)
            value = existing
        config[key] = value


def _special_tokens(config: dict, added: dict[int, AddedToken]) -> tuple[dict, list]:
    """The named special tokens (standard names first, then the model's own `*_token` keys) and the extra ones."""
    by_text = {str(t): t for t in added.values()}
    named = {}
    for name in NAMED_SPECIAL_TOKENS:
        value = _added_token(config.get(name))
        if value is not None:
            named[name] = by_text.get(str(value), value)
    # The model's own names (`image_token`, ...): those written as AddedToken fields first, then plain strings,
    # as transformers registers them.
    own = [(k, v) for k, v in config.items() if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS]
    named.update((k, _added_token(v)) for k, v in own if isinstance(v, dict) and v.get("__type") == "AddedToken")
    named.update((k, v) for k, v in own if isinstance(v, str))
    extra = config.get("extra_special_tokens")
    if not extra and "additional_special_tokens" in config:
        extra = config["additional_special_tokens"]
    if isinstance(extra, dict):
        named.update((k, _added_token(v)) for k, v in extra.items())
        extra = []
    return named, [_added_token(t) for t in extra or []]


def _add_tokens(backend: Tokenizer, added: dict[int, AddedToken], named: dict, extra: list) -> None:
    """One `add_tokens` call with the config's added tokens (by id) and the special tokens the tokenizer lacks."""
    tokens = [t for _, t in sorted(added.items())]
    known = {t.content for t in backend.get_added_tokens_decoder().values()} | {str(t) for t in tokens}
    for value in [*named.values(), *extra]:
        if value is not None and str(value) not in known and value not in tokens:
            tokens.append(value)
    named_texts = {str(v) for v in named.values()}
    for i, token in enumerate(tokens):
        if isinstance(token, str):
            tokens[i] = AddedToken(token, special=True)
        elif not token.special and str(token) in named_texts:
            token.special = True
    if tokens:
        backend.add_tokens(tokens)


def _chat_templates(config: dict, model_dir: str) -> dict[str, str]:
    """Name -> template. Files win over the config's entry; one unnamed template is the default."""
    templates = {}
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            templates[DEFAULT_TEMPLATE] = f.read()
    folder = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jinja"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {DEFAULT_TEMPLATE: entry}
    if isinstance(entry, (list, tuple)):
        return {t["name"]: t["template"] for t in entry}
    return {}


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization: WordPiece-era spacing before punctuation and contractions.
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
        .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re")
    )
