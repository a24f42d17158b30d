"""`--load-format dummy`: a model served from its config.json alone, with random weights built on the device and
a synthetic tokenizer for its whole vocabulary. A tiny Llama-shaped config here (the suite runs on 2 cores);
the published Llama-3.2-1B and Llama-3.1-8B configs in bench/models run through bench/device.sh."""
import json
import os

import httpx
import pytest
import torch
from openai import OpenAI

from tests.supervise_process import Supervise

TINY = os.path.join(os.path.dirname(__file__), "models", "tiny-llama")
VOCAB = json.load(open(os.path.join(TINY, "config.json")))["vocab_size"]
BOS, EOT, START_HEADER = 2048, 2048 + 9, 2048 + 6  # Llama 3's layout: the top 256 ids are the special tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with Supervise("--model", TINY, "--load-format", "dummy", "--max-model-len", "256",
                   env={"XDG_CACHE_HOME": str(cache)}) as server:
        yield server, cache


def test_it_serves_the_openai_client(served):
    server, _ = served
    client = OpenAI(base_url=server.base_url, api_key="unused")
    (card,) = client.models.list().data
    assert card.id == TINY
    chat = client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content  # random weights: any text
    stream = client.completions.create(model=card.id, prompt="the quick brown fox", max_tokens=6, stream=True,
                                       extra_body={"ignore_eos": True}, temperature=0.8, seed=1)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_the_tokenizer_covers_the_vocabulary(served):
    server, _ = served
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=30)  # noqa: E731
    text = "Paris is the capital of France. café 🥐"
    ids = post("/tokenize", {"prompt": text}).json()["tokens"]
    assert ids[0] == BOS and max(ids) < VOCAB
    assert post("/detokenize", {"tokens": ids[1:]}).json()["prompt"] == text
    for token in (0, 255, 300, BOS - 1, BOS, VOCAB - 1):  # bytes, words, special tokens: each decodes
        assert post("/detokenize", {"tokens": [token]}).status_code == 200
    assert post("/detokenize", {"tokens": [VOCAB]}).status_code == 400
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat[:2] == [BOS, START_HEADER] and EOT in chat  # Llama 3's chat template


def test_only_a_tokenizer_is_written(served):
    _, cache = served
    native = cache / "supervise" / "native"  # the engine's CPU kernels, built for this CPU (with a compiler)
    assert not native.exists() or all(p.suffix == ".so" for p in native.iterdir())
    (made,) = (p for p in (cache / "supervise").iterdir() if p != native)
    assert made.name.startswith("dummy-tiny-llama-")
    assert sorted(p.name for p in made.iterdir()) == [".supervise-complete", "config.json", "tokenizer.json",
                                                       "tokenizer_config.json"]
    assert os.listdir(TINY) == ["config.json"]


def test_random_weights_are_built_on_the_device_the_same_every_time():
    from enginecore.loader import load_model

    first, second = (load_model(TINY, "cpu", "float32", load_format="dummy").model for _ in range(2))
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    weight = first.model.layers[0].mlp.down_proj.weight
    assert weight.device.type == "cpu" and abs(weight.std().item() - 0.02) < 0.002
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))
    assert first.lm_head.weight.data_ptr() == first.model.embed_tokens.weight.data_ptr()  # tied, as configured
    assert not torch.equal(first.model.layers[0].self_attn.q_proj.weight, first.model.layers[1].self_attn.q_proj.weight)
