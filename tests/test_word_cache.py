"""The word cache of the API server's tokenizing (apiserver.word_cache, apiserver.split_regex): for each kind
of byte-level BPE tokenizer it covers, the ids it gives are the Rust tokenizer's own, on random and on
exhaustive short ASCII text and on mostly-ASCII text; other text and other tokenizers go to the tokenizer; the
cache stays bounded."""
import itertools
import json
import os
import random
import re

import pytest
from tokenizers import Tokenizer

import apiserver.word_cache as word_cache
from apiserver import split_regex
from apiserver.renderer import Renderer, load_tokenizer
from apiserver.word_cache import WordCache
from enginecore.model_source import resolve_model

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Pieces that exercise every branch of these regexes: contractions in both cases, letter runs with capitals,
# digit runs, punctuation runs, and whitespace runs of each kind.
PIECES = ["the", " the", "Hello", "WORLD", "iPhone", "x", "'s", "'S", "'ll", "'LL", "'re", "'d", "don't", "I'M",
          "42", "1234567", " 3.14", "!", "?!", "...", " --", "/", "//", "(", "\"", "'", "`", "#", "<", "|>", "_a",
          "a_b", "$5", "{}", "[x]", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\t \n ", "\r", "\n "]


def _with_pre_tokenizer(pre_tokenizer: dict, normalizer=None) -> Tokenizer:
    """The embedded model's tokenizer (its BPE vocabulary and merges) under another pre-tokenizer."""
    spec = json.load(open(os.path.join(resolve_model(None), "tokenizer.json")))
    spec["pre_tokenizer"] = pre_tokenizer
    spec["normalizer"] = normalizer
    return Tokenizer.from_str(json.dumps(spec))


def _split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}


COVERED = {
    "gpt2 (embedded)": lambda: Tokenizer.from_file(os.path.join(resolve_model(None), "tokenizer.json")),
    "llama3 split": lambda: _with_pre_tokenizer(_split_then_bytes(LLAMA3_SPLIT)),
    "o200k split": lambda: _with_pre_tokenizer(_split_then_bytes(O200K_SPLIT)),
    "qwen2 (NFC)": lambda: _with_pre_tokenizer(_split_then_bytes(LLAMA3_SPLIT), {"type": "NFC"}),
}


def _theirs(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", COVERED)
def test_random_ascii_text_gets_the_tokenizers_ids(kind):
    tokenizer = COVERED[kind]()
    words = WordCache.for_tokenizer(tokenizer)
    assert words is not None
    rng = random.Random(kind)
    printable = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\r"]
    for _ in range(3000):
        if rng.random() < 0.5:
            text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        else:
            text = "".join(rng.choice(printable) for _ in range(rng.randint(0, 40)))
        assert words.encode(text) == _theirs(tokenizer, text), repr(text)
    # Again, from the cache now.
    rng = random.Random(kind)
    text = "".join(rng.choice(PIECES) for _ in range(2000))
    assert words.encode(text) == _theirs(tokenizer, text) == words.encode(text)


@pytest.mark.parametrize("kind", ["gpt2 (embedded)", "llama3 split"])
def test_every_short_ascii_text(kind):
    # Every string of up to two characters of the covered set, and three from a set of each class.
    tokenizer = COVERED[kind]()
    words = WordCache.for_tokenizer(tokenizer)
    chars = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\r"]
    texts = [a + b for a in chars for b in chars] + chars
    texts += ["".join(t) for t in itertools.product("aA1 '\n.s\t", repeat=3)]
    for text in texts:
        assert words.encode(text) == _theirs(tokenizer, text), repr(text)


# Characters the ASCII path leaves to the tokenizer: letters, marks (NFC composes "e" + U+0301), digits, quotes,
# emoji, and every kind of whitespace or control character the regex engines might class differently.
OTHER = ["é", "café", "naïve", "e\u0301", "\u0301", "Ω", "日本語", "テキスト", "٣", "½", "’", "“", "”", "—", "🥐", "👍🏽",
         "\u00a0", "\u3000", "\u2028", "\u2009", "\x85", "\x1c", "\x1f", "\x0b", "\x0c", "\x00", "\x7f", "\ufeff"]


@pytest.mark.parametrize("kind", COVERED)
def test_mostly_ascii_text_with_other_characters(kind):
    # Cut before spaces after printable ASCII: the parts with other characters go to the tokenizer, the rest
    # through the cache, and the ids are still the tokenizer's.
    tokenizer = COVERED[kind]()
    words = WordCache.for_tokenizer(tokenizer)
    rng = random.Random(kind + " mixed")
    for _ in range(3000):
        pieces = PIECES + OTHER[:rng.randint(1, len(OTHER))]
        text = "".join(rng.choice(pieces if rng.random() < 0.9 else OTHER) for _ in range(rng.randint(1, 40)))
        ids = words.encode(text)
        assert ids is None or ids == _theirs(tokenizer, text), repr(text)
        if ids is None:
            runs = len(re.findall(r"[^\t\n\r\x20-\x7e]+", text))
            assert runs > max(word_cache.MAX_MIXED_RUNS, len(text) // word_cache.CHARS_PER_MIXED_RUN)


def test_text_that_is_not_mostly_ascii_goes_to_the_tokenizer():
    words = WordCache.for_tokenizer(COVERED["gpt2 (embedded)"]())
    many_runs = " ".join(["the café"] * (word_cache.MAX_MIXED_RUNS + 1))
    assert words.encode(many_runs) is None
    assert words.encode(" ".join(["the café"] * word_cache.MAX_MIXED_RUNS)) is not None
    long_text = "a few more words " * 100
    assert words.encode(long_text + many_runs) is not None  # one run per 48 characters or fewer
    assert words.encode(long_text + " ".join(["the café"] * 200)) is None
    for text in OTHER:
        assert words.encode(f"plain {text} text") == _theirs(COVERED["gpt2 (embedded)"](), f"plain {text} text")


def test_a_split_regex_not_known_to_cut_keeps_other_text_whole():
    tokenizer = _with_pre_tokenizer(_split_then_bytes(r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"))
    words = WordCache.for_tokenizer(tokenizer)
    assert words.encode("plain words, 12") == _theirs(tokenizer, "plain words, 12")
    assert words.encode("plain café") is None


@pytest.mark.parametrize("pre_tokenizer,normalizer", [
    ({"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, None),
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}, None),
    ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}, None),
    ({"type": "Whitespace"}, None),
    (_split_then_bytes(r"\p{Greek}+|\s+|\S"), None),  # a class it cannot translate
    (_split_then_bytes(r"\P{L}+|\p{L}+"), None),
    (_split_then_bytes(r"^\s+|\S+|\s+"), None),  # onig's ^ is a line anchor
    (_split_then_bytes(r"(?m)\s+|\S+"), None),  # inline flags: onig's m is Python's s
    (_split_then_bytes(r"\S+\Z|\S+|\s+"), None),  # \Z: end of text in Python, before a final newline in onig
    (_split_then_bytes(LLAMA3_SPLIT), {"type": "Lowercase"}),
])
def test_tokenizers_it_cannot_reproduce_get_none(pre_tokenizer, normalizer):
    assert WordCache.for_tokenizer(_with_pre_tokenizer(pre_tokenizer, normalizer)) is None


def test_a_split_that_leaves_gaps_goes_to_the_tokenizer():
    # Isolated splits keep the text between matches as words: this path does not, so it steps aside.
    tokenizer = _with_pre_tokenizer(_split_then_bytes(r"\p{L}+"))
    words = WordCache.for_tokenizer(tokenizer)
    assert words is not None
    assert words.encode("abc") == _theirs(tokenizer, "abc")
    assert words.encode("abc, def") is None


def test_the_cache_is_bounded(monkeypatch):
    # In the ids it holds, so words of many ids each (random letters: a hostile client's) fill it no further.
    monkeypatch.setattr(word_cache, "MAX_HELD_IDS", 100)
    tokenizer = COVERED["gpt2 (embedded)"]()
    words = WordCache.for_tokenizer(tokenizer)
    rng = random.Random(1)
    for _ in range(50):
        text = " ".join("".join(rng.choice("abcdefghijqxzv") for _ in range(rng.randint(1, 30))) for _ in range(20))
        text += " " + "z" * 200  # too long a word to keep
        assert words.encode(text) == _theirs(tokenizer, text)
        held = len(words._single) + sum(max(1, len(ids)) for ids in words._multi.values())
        assert held == words._held_ids <= 100
    assert " " + "z" * 200 not in words._multi
    assert max(map(len, words._multi.values())) > 3


@pytest.mark.parametrize("config_dir", [None, "tests/models/tiny-llama"])
def test_the_renderer_with_and_without_special_tokens(config_dir, tmp_path, monkeypatch):
    # The embedded model's post-processor adds nothing; the synthetic Llama 3 tokenizer of a dummy model adds
    # BOS: with special tokens, the renderer puts the post-processor's ids around the cached path's.
    from enginecore.model_source import dummy_model_dir

    directory = resolve_model(None)
    if config_dir is not None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        directory = dummy_model_dir(os.path.join(os.path.dirname(os.path.dirname(__file__)), config_dir))
    renderer = Renderer(load_tokenizer(directory))
    backend = renderer.tokenizer
    assert renderer._segments.words is not None
    bos = config_dir is not None
    rng = random.Random(2)
    texts = ["", "Hello, world!", "two  spaces\n\nand 'quotes'", "café et 🥐 ensemble"]
    texts += ["".join(rng.choice(PIECES) for _ in range(40)) for _ in range(200)]
    for text in texts:
        for special in (False, True):
            ids = renderer.encode(text, add_special_tokens=special)
            assert ids == backend.encode(text, add_special_tokens=special).ids, repr(text)
        assert (renderer.encode(text, add_special_tokens=True)[:1] == [backend.token_to_id("<|begin_of_text|>")]) == bos


def test_long_runs_of_one_class():
    # What a careless or hostile client may send, up to the size tokenized inline (prompt_offload): same ids.
    tokenizer = COVERED["gpt2 (embedded)"]()
    words = WordCache.for_tokenizer(tokenizer)
    rng = random.Random(3)
    for text in (" " * 16000 + "a", "'" * 16000, "a" * 16000, "1" * 16000, " \n" * 8000, "\t " * 8000 + "x", "'s" * 8000,
                 ("\n" * 50 + " " * 50 + "x") * 150, "".join(chr(rng.randint(32, 126)) for _ in range(16000))):
        assert words.encode(text) == _theirs(tokenizer, text)


@pytest.mark.parametrize("kind", COVERED)
def test_the_cuts_fall_between_the_tokenizers_own_words(kind):
    # Stronger than equal ids (a vocabulary may tokenize two splits alike): the tokenizer's own pre-tokenizer
    # splits the text into the same words whole as in the parts between the cuts.
    pre_tokenizer = COVERED[kind]().pre_tokenizer
    rng = random.Random(kind + " cuts")
    whitespace = [" ", "  ", "\t", "\n", " \n", "\u00a0", "\u3000", "\x85", "\x1c", "\u2009"]
    for _ in range(3000):
        text = "".join(rng.choice(PIECES + OTHER + whitespace * 3) for _ in range(rng.randint(1, 30)))
        bounds = [0] + [m.start() for m in split_regex.CUT.finditer(text)] + [len(text)]
        parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        whole = [word for word, _ in pre_tokenizer.pre_tokenize_str(text)]
        assert [word for part in parts for word, _ in pre_tokenizer.pre_tokenize_str(part)] == whole, repr(text)


def test_normalizers_that_may_change_text_at_a_cut_keep_other_text_whole():
    tokenizer = _with_pre_tokenizer(_split_then_bytes(LLAMA3_SPLIT), {"type": "NFKC"})
    words = WordCache.for_tokenizer(tokenizer)
    assert words.encode("plain text") == _theirs(tokenizer, "plain text")
    assert words.encode("plain café") is None


def test_a_vocabulary_without_some_bytes(monkeypatch):
    # BPE drops what its vocabulary cannot spell (no unknown token): the same here, and words of no ids still
    # count against the bound.
    monkeypatch.setattr(word_cache, "MAX_HELD_IDS", 50)
    spec = json.load(open(os.path.join(resolve_model(None), "tokenizer.json")))
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if not {"z", "q"} & set(t)}
    spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                               if not {"z", "q"} & set(m if isinstance(m, str) else " ".join(m))]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    words = WordCache.for_tokenizer(tokenizer)
    for text in ("jazz fizz", "zzz", "pizza time", "a z"):
        assert words.encode(text) == _theirs(tokenizer, text)
    # 62 words of no ids ("z", "q", "zq", ..., "qqqqq"), between commas.
    spellings = ",".join("".join(w) for n in range(1, 6) for w in itertools.product("zq", repeat=n))
    assert words.encode(spellings) == _theirs(tokenizer, spellings)
    assert () in words._multi.values()
    assert len(words._single) + len(words._multi) <= 50


def test_a_word_met_twice_in_a_new_text_is_tokenized_once():
    tokenizer = COVERED["gpt2 (embedded)"]()
    words = WordCache.for_tokenizer(tokenizer)
    text = "the cat, the dog, the cat and the dog"
    assert words.encode(text) == _theirs(tokenizer, text)
    distinct = set(words._split(text))
    assert len(words._single) + len(words._multi) == len(distinct)
    assert words._held_ids == sum(len(_theirs(tokenizer, w)) for w in distinct)
