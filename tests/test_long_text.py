"""Long texts tokenized in pieces (apiserver.long_text): the ids are the Rust tokenizer's for the whole text, with
and without special tokens, added tokens and other characters inside, for each kind of split regex it cuts; a
tokenizer it cannot cut exactly is not cut."""
import random

import pytest

from apiserver import long_text
from apiserver.renderer import _SegmentCache
from tests.test_word_cache import COVERED, LLAMA3_SPLIT, _split_then_bytes, _with_pre_tokenizer

WORDS = ["hello", " world", ",", "  ", "\n", "\n\n ", "<|im_start|>", "<|im_end|>", "é", " 日本語", " 123", "4567",
         "\t", "😀", "'s", "  x", "!", " ?", "a" * 300, "<|im_start|>user\na<|im_end|>\n" * 50]


@pytest.mark.parametrize("kind", COVERED)
def test_pieces_give_the_whole_texts_ids(kind, monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 2000)  # many pieces, and batches of several texts
    tokenizer = COVERED[kind]()
    assert long_text.cuttable(tokenizer)
    rng = random.Random(3)
    texts = ["".join(rng.choice(WORDS) for _ in range(rng.randint(1, 1500))) for _ in range(8)] + ["x"]
    assert max(len(long_text.pieces(t)) for t in texts) > 10
    for special, affixes in ((False, None), (True, ([7], [9]))):
        got = long_text.encode(tokenizer, texts, _SegmentCache(tokenizer).split, special, affixes)
        want = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        if affixes:
            want = [affixes[0] + ids + affixes[1] for ids in want]
        assert got == want


def test_special_tokens_without_known_affixes_keep_the_text_whole(monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 100)
    tokenizer = COVERED["gpt2 (embedded)"]()
    text = "word " * 1000
    whole = tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids
    assert long_text.encode(tokenizer, [text], _SegmentCache(tokenizer).split, True, None) == [whole]


def test_tokenizers_it_cannot_cut_exactly():
    assert not long_text.cuttable(_with_pre_tokenizer(_split_then_bytes(r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+")))
    assert not long_text.cuttable(_with_pre_tokenizer(_split_then_bytes(LLAMA3_SPLIT), {"type": "NFKC"}))
    tokenizer = COVERED["gpt2 (embedded)"]()
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken("two words")])
    assert not long_text.cuttable(tokenizer)
