"""The API server's tokenizer and chat templates, read without transformers (apiserver.hf_tokenizer,
apiserver.chat_template), give what transformers' PreTrainedTokenizerFast gives from the same files: token ids
with and without special tokens, decoded text with and without them, rendered chats and their ids, and the
same refusals. The embedded model's files, then variations of them that exercise the rules one by one."""
import json
import os
import shutil

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from apiserver.errors import InvalidRequest
from apiserver.hf_tokenizer import HFTokenizer
from apiserver.renderer import Renderer
from enginecore.model_source import resolve_model

TEXTS = [
    "",
    "Hello, world!",
    "Paris is the capital of France. It isn't far , is it ?",
    "café — «la vie» 🥐🇫🇷 naïve Œuvre 日本語のテキスト、中文文本。한국어",
    "  leading spaces,\ttabs\nand\r\nnewlines  \n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special<|endoftext|>inside<repo_name>words <file_sep> and <|im_end|>",
    "a <new_tok>b <new_tok> c<new_special>d <image> x<|extra|>y",
    "don't we 're you 've I 'm it 's a .",
    "x" * 300 + " " + "é" * 40,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? <|im_end|>"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 🥐\n\nwith newlines  "}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "name", "name": "bob"}, {"role": "assistant", "content": "  spaced  "}],
]


def same_everything(model_dir: str, conversations=CONVERSATIONS, kwargs_list=({},)):
    ours = HFTokenizer(model_dir)
    theirs = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert ours.special_tokens == theirs.special_tokens_map
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()
    }
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    renderer = Renderer(ours)
    for messages in conversations:
        for kwargs in kwargs_list:
            for generation_prompt, continue_final in ((True, False), (False, False), (False, True)):
                options = dict(add_generation_prompt=generation_prompt, continue_final_message=continue_final)
                try:
                    expected = theirs.apply_chat_template(messages, tokenize=False, **options, **kwargs)
                except (jinja2.TemplateError, ValueError) as exc:
                    with pytest.raises(InvalidRequest):
                        renderer.chat_text(messages, generation_prompt, continue_final, kwargs)
                    print("both refused:", exc)
                    continue
                assert renderer.chat_text(messages, generation_prompt, continue_final, kwargs) == expected
                expected_ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **options,
                                                          **kwargs)
                assert renderer.render_chat(messages, generation_prompt, continue_final, kwargs) == list(expected_ids)
    return ours, theirs


@pytest.fixture(scope="module")
def embedded_dir():
    return resolve_model(None)


def variant(tmp_path, embedded_dir, config: dict | None = None, tokenizer_json=None, files: dict | None = None):
    """A copy of the embedded model's tokenizer files with another tokenizer_config.json (and more files)."""
    target = tmp_path / "tok"
    target.mkdir()
    tokenizer = json.load(open(os.path.join(embedded_dir, "tokenizer.json")))
    if tokenizer_json:
        tokenizer_json(tokenizer)
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    if config is not None:
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(text)
    return str(target)


def test_the_embedded_model(embedded_dir):
    same_everything(embedded_dir)


def _token(content, **flags):
    return {"content": content, "lstrip": False, "rstrip": False, "single_word": False, "normalized": False,
            "special": False, **flags}


def test_added_and_special_tokens_of_the_config(tmp_path, embedded_dir):
    """Tokens the config adds (with lstrip/rstrip/single_word rules), special tokens the tokenizer lacks, the
    model's own `*_token` names, extra special tokens, BOS/EOS written by the post-processor, and tokenizer.json's
    truncation and padding left off."""
    added = {str(i): t for i, t in enumerate(json.load(open(os.path.join(embedded_dir, "tokenizer.json")))["added_tokens"])}
    for t in added.values():
        t.pop("id")
    added["49152"] = _token("<new_tok>", lstrip=True, rstrip=True, normalized=True)
    added["49153"] = _token("<new_special>", special=True, single_word=True)
    config = {
        "added_tokens_decoder": added,
        "bos_token": {"__type": "AddedToken", **_token("<|im_start|>", special=True)},
        "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<|endoftext|>",
        "image_token": "<image>", "additional_special_tokens": ["<|extra|>"],
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}"
                         "{% endfor %}{{ image_token }}{% if add_generation_prompt %}assistant:{% endif %}",
    }

    def bos_and_eos(tokenizer):  # and a truncation and padding that transformers' encode leaves off
        tokenizer["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
        tokenizer["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                                "pad_id": 2, "pad_type_id": 0, "pad_token": "<|im_end|>"}
        tokenizer["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
                               "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}},
        }

    ours, _ = same_everything(variant(tmp_path, embedded_dir, config, bos_and_eos))
    assert ours.encode("hi")[0] == 1 and ours.encode("hi")[-1] == 2 and len(ours.encode("hi", False)) == 1


def test_legacy_special_tokens_map_and_split_special_tokens(tmp_path, embedded_dir):
    config = {"split_special_tokens": True, "add_bos_token": True,
              "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"}
    files = {"special_tokens_map.json": json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        "eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<tool>"]})}
    same_everything(variant(tmp_path, embedded_dir, config, files=files))


TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' and not loop.first -%}{{ raise_exception('system must come first') }}{%- endif -%}
  {%- if message['content'] == '' -%}{% continue %}{%- endif -%}
  {%- set ns.turns = ns.turns + 1 %}
  <|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}
  {% generation %}{{ message['content'] | trim }}{% endgeneration %}<|im_end|>
  {{ {'turn': ns.turns, 'role': message.role, "html": "<b>&</b>"} | tojson }}
  {%- if loop.index >= 8 %}{% break %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant{% if enable_thinking is defined and enable_thinking %} <think>{% endif %}
{% endif -%}
{{ dict(a=1) | tojson }}"""


def test_template_features_named_templates_and_jinja_files(tmp_path, embedded_dir):
    """namespace, loop controls, `{% generation %}`, tojson without HTML escaping, raise_exception, chat_template_kwargs,
    templates from chat_template.jinja and additional_chat_templates/, which win over the config's list."""
    conversations = CONVERSATIONS + [[{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]]
    config = {"eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": "unused"}]}
    files = {"chat_template.jinja": TEMPLATE, "additional_chat_templates/tool_use.jinja": "{{ messages | length }}"}
    directory = variant(tmp_path, embedded_dir, config, files=files)
    ours, theirs = same_everything(directory, conversations, ({}, {"enable_thinking": True}))
    assert ours.chat_templates == theirs.chat_template == {"default": TEMPLATE, "tool_use": "{{ messages | length }}"}


def test_named_templates_in_the_config(tmp_path, embedded_dir):
    config = {"eos_token": "<|im_end|>", "chat_template": [
        {"name": "default", "template": TEMPLATE}, {"name": "rag", "template": "{{ documents }}"}]}
    ours, theirs = same_everything(variant(tmp_path, embedded_dir, config))
    assert ours.chat_templates == theirs.chat_template


def test_clean_up_tokenization_spaces_applies_to_wordpiece_only(tmp_path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    tokenizer.train_from_iterator([t.lower() for t in TEXTS] * 3, trainer)
    for clean in (True, False):
        directory = tmp_path / f"wordpiece-{clean}"
        directory.mkdir()
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "clean_up_tokenization_spaces": clean, "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "pad_token": "[PAD]", "chat_template": "{% for m in messages %}[CLS] {{ m.content }} [SEP]{% endfor %}"}))
        ours, _ = same_everything(str(directory))
        assert ours.clean_up_tokenization_spaces is clean


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer(str(tmp_path))


def test_templates_that_refuse_a_conversation(embedded_dir, tmp_path):
    directory = variant(tmp_path, embedded_dir, {"eos_token": "<|im_end|>"}, files={"chat_template.jinja": TEMPLATE})
    renderer = Renderer(HFTokenizer(directory))
    with pytest.raises(InvalidRequest, match="system must come first"):
        renderer.chat_text([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(InvalidRequest, match="empty conversation"):
        renderer.chat_text([])
    shutil.rmtree(directory)


@pytest.mark.parametrize("config_dir", ["tests/models/tiny-llama", "bench/models/llama-3.2-1b"])
def test_the_synthetic_tokenizer_of_dummy_models(config_dir, tmp_path, monkeypatch):
    """What `--load-format dummy` makes for a directory with only a config.json: transformers reads it the same,
    it covers the config's vocabulary, and its special tokens sit where the config's ids say (Llama 3's layout)."""
    from enginecore.model_source import dummy_model_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), config_dir)
    directory = dummy_model_dir(root)
    assert dummy_model_dir(root) == directory != root  # made once, then found in the cache
    ours, theirs = same_everything(directory)
    config = json.load(open(os.path.join(root, "config.json")))
    assert ours.backend.get_vocab_size() == len(theirs) == config["vocab_size"]
    assert ours.backend.id_to_token(config["bos_token_id"]) == ours.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert ours.backend.id_to_token(config["eos_token_id"]) == ours.special_tokens["eos_token"] == "<|end_of_text|>"
    assert ours.encode("hello world")[0] == config["bos_token_id"]
    words = ours.decode(list(range(1000, 1100)))
    assert words.isascii() and len(words.split()) >= 50  # random ids read as words
