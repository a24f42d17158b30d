"""The byte-level detokenizing table (apiserver/byte_stream.py) against tokenizers' own DecodeStream, step by
step: random token sequences of byte fragments, multi-byte characters, special, added and unknown ids, with
special tokens skipped and kept; which tokenizers get the table; and a prompt that ends inside a character."""
from __future__ import annotations

import json
import random

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.decoders import DecodeStream

from apiserver.byte_stream import ByteLevelStream, byte_tables
from apiserver.detokenizer import IncrementalDetokenizer
from apiserver.renderer import load_tokenizer
from enginecore.model_source import resolve_model
from tests.supervise_process import Supervise

TEXTS = ["café — «la vie» 🥐🇫🇷 naïve", "日本語のテキスト、中文。한국어", "emoji 👍🏽 👨‍👩‍👧 \ufffd end", "tabs\tand\r\nnewlines  "]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The embedded model's tokenizer, with an added plain token and an added special one besides its own."""
    tok = Tokenizer.from_str(load_tokenizer(resolve_model(None)).backend.to_str())
    tok.add_tokens([AddedToken("<plain added>", special=False)])
    tok.add_special_tokens([AddedToken("<|extra special|>", special=True)])
    return tok


def _pool(tok: Tokenizer) -> list[int]:
    """Ids to draw from: every id of some multi-byte texts (their byte fragments among them), single-byte
    fragments, special and added tokens, ids past the vocabulary, and random vocabulary ids."""
    ids = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False).ids]
    size = tok.get_vocab_size(with_added_tokens=True)
    fragments = [i for i in range(size) if (t := tok.id_to_token(i)) and len(t) == 1 and ord(t) >= 0x80][:64]
    added = list(tok.get_added_tokens_decoder())
    rng = random.Random(7)
    return ids + fragments + added * 3 + [size, size + 5, 10**6] + [rng.randrange(size) for _ in range(200)]


def _clean_context(tok: Tokenizer, table: list[bytes], rng: random.Random, pool: list[int]) -> list[int]:
    """Up to 4 ids whose text does not end in U+FFFD: where DecodeStream's own output is sound (after other
    contexts its first text starts with the context's, see below)."""
    while True:
        context = [rng.choice(pool) for _ in range(rng.randrange(0, 5))]
        if not b"".join(table[i] for i in context if i < len(table)).decode("utf-8", "replace").endswith("\ufffd"):
            return context


@pytest.mark.parametrize("skip", [True, False])
def test_every_step_gives_what_decode_stream_gives(tokenizer, skip):
    tables = byte_tables(tokenizer)
    assert tables is not None  # the embedded model's tokenizer is byte-level BPE
    table = tables.of(skip)
    pool = _pool(tokenizer)
    rng = random.Random(1 if skip else 2)
    steps = emitted = 0
    for _ in range(300):
        context = _clean_context(tokenizer, table, rng, pool)
        ours = ByteLevelStream(table, context)
        theirs = DecodeStream(ids=context or None, skip_special_tokens=skip)
        for _ in range(rng.randrange(1, 40)):
            token = rng.choice(pool)
            expected = theirs.step(tokenizer, token)
            assert ours.step(tokenizer, token) == expected, (context, token)
            steps += 1
            emitted += expected is not None
    assert steps > 3000 and 0.3 * steps < emitted < steps  # some steps held back text, most gave some


def test_special_tokens_are_skipped_or_kept(tokenizer):
    tables = byte_tables(tokenizer)
    special = tokenizer.token_to_id("<|extra special|>")
    plain = tokenizer.token_to_id("<plain added>")
    for skip, expected in ((True, [None, "<plain added>"]), (False, ["<|extra special|>", "<plain added>"])):
        stream = ByteLevelStream(tables.of(skip))
        assert [stream.step(tokenizer, special), stream.step(tokenizer, plain)] == expected


def test_a_prompt_that_ends_in_an_invalid_byte_leaks_none_of_its_text(tokenizer):
    # DecodeStream seeded with such a prompt gives the prompt's text with the first token's.
    fragment = tokenizer.token_to_id("¥")  # ByteLevel's character for the byte 0xA5: a continuation byte alone
    prompt = tokenizer.encode("Free perch", add_special_tokens=False).ids + [fragment]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    detokenizer.add_tokens(tokenizer.encode(" Assyria", add_special_tokens=False).ids)
    assert detokenizer.take_delta(final=True) == " Assyria"


def test_a_prompt_that_ends_inside_a_character_leaks_none_of_its_text(tokenizer):
    # The prompt's last token is the first bytes of 🥐; the first tokens generated are its last: their text is
    # the whole character, and nothing of the prompt before it (DecodeStream gives "caf🥐" here).
    croissant = tokenizer.encode("🥐", add_special_tokens=False).ids
    assert len(croissant) > 1
    prompt = tokenizer.encode("caf", add_special_tokens=False).ids + croissant[:1]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    detokenizer.add_tokens(croissant[1:] + tokenizer.encode(" ok", add_special_tokens=False).ids)
    assert detokenizer.take_delta(final=True) == "🥐 ok"


def test_tokenizers_not_byte_level_keep_decode_stream(tmp_path):
    from tokenizers import decoders, models

    tok = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    assert byte_tables(tok) is None
    detokenizer = IncrementalDetokenizer(tok, [0])
    detokenizer.add_tokens([1, 0])
    assert detokenizer.take_delta(final=True) == " world hello"


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used():
    # An added token whose content has ByteLevel's stand-in for a space ("Ġ"): the decoder maps it back to
    # a space, its content does not, so the table does not check out and DecodeStream decodes.
    tok = Tokenizer.from_str(load_tokenizer(resolve_model(None)).backend.to_str())
    tok.add_tokens([AddedToken("Ġodd", special=False)])
    text = tok.decode([tok.token_to_id("Ġodd")])
    if text == "Ġodd":
        pytest.skip("this tokenizers version decodes added tokens as their content: nothing disagrees")
    assert byte_tables(tok) is None


def test_a_completion_after_token_ids_that_end_in_a_fragment_is_only_its_own_text(tokenizer):
    clean = tokenizer.encode("Free perch", add_special_tokens=False).ids
    for cut in ("¥", "ð"):  # a continuation byte alone; the lead byte of a 4-byte character
        assert tokenizer.token_to_id(cut) is not None
    with Supervise("--model", "sim:2") as server:
        def text(prompt: list[int], stream: bool) -> str:
            body = {"model": "sim:2", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": stream}
            if not stream:
                return httpx.post(f"{server.base_url}/completions", json=body, timeout=30).json()["choices"][0]["text"]
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as r:
                chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
            return "".join(json.loads(c)["choices"][0]["text"] for c in chunks)

        expected = text(clean, False)
        assert expected and "perch" not in expected
        for cut in ("¥", "ð"):
            for stream in (False, True):
                got = text(clean + [tokenizer.token_to_id(cut)], stream)
                assert "perch" not in got, (cut, stream, got)
                assert got.endswith(expected[1:]), (cut, stream, got)  # its first token may complete the cut
