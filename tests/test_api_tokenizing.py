"""What the word cache changes for a client: nothing but speed. A server with it and one without
(--no-tokenizer-word-cache) give every prompt the ids the Rust tokenizer gives it, through /tokenize and in the
usage of chat and text completions, and each says in its log how it tokenizes."""
import random
import subprocess

import httpx
import pytest

from apiserver.hf_tokenizer import HFTokenizer
from enginecore.model_source import resolve_model
from tests.supervise_process import SUPERVISE, Supervise

MODEL = "sim:2"
TEXTS = [
    "Hello, world",
    "The committee met on Tuesday; costs rose 4.5% in 2024 (version 3).\n\nIt's done, isn't it?",
    "“We can’t wait forever,” said the chair — who’d spent 12 years on the board at the café.",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 👍🏽 and   spaces\t\ttabs\r\nnewlines  ",
    "<|im_start|>user\nan added token inside text<|im_end|>",
    " " * 3000 + "a",
    "word " * 4000,  # 20K characters: tokenized in a thread, not by the cache
]


@pytest.fixture(scope="module")
def servers():
    with Supervise("--model", MODEL) as cached, Supervise("--model", MODEL, "--no-tokenizer-word-cache") as plain:
        yield cached, plain


@pytest.fixture(scope="module")
def tokenizer():
    return HFTokenizer(resolve_model(None)).backend


def test_each_server_says_how_it_tokenizes(servers):
    cached, plain = servers
    assert "tokenizing: a word cache for plain and mostly-ASCII text, else the Rust tokenizer" in cached.log()
    assert "tokenizing: the Rust tokenizer for all text" in plain.log()


def test_tokenize_gives_the_tokenizers_ids_with_the_cache_and_without(servers, tokenizer):
    rng = random.Random(0)
    texts = TEXTS + ["".join(chr(rng.randint(32, 126)) for _ in range(300)) for _ in range(20)]
    for server in servers:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for text in texts:
                for special in (True, False):
                    body = {"model": MODEL, "prompt": text, "add_special_tokens": special}
                    ids = http.post("/tokenize", json=body).json()["tokens"]
                    assert ids == tokenizer.encode(text, add_special_tokens=special).ids, repr(text[:80])


def test_chat_and_completion_usage_agree(servers):
    counts = []
    for server in servers:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            usage = []
            for text in TEXTS:
                chat = http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
                completion = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, "prompt": text})
                assert chat.status_code == completion.status_code == 200, chat.text + completion.text
                usage.append((chat.json()["usage"]["prompt_tokens"], completion.json()["usage"]["prompt_tokens"]))
            counts.append(usage)
    assert counts[0] == counts[1]


def test_the_switch_is_refused_with_grpc():
    result = subprocess.run([SUPERVISE, "--grpc", "--no-tokenizer-word-cache"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--tokenizer-word-cache applies to the HTTP API" in result.stderr
