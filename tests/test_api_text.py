"""The API server's text handling without a server: incremental detokenization (whole UTF-8 characters,
right spaces), stop strings (never leaked, also across tokens), and the tokenizer's segment cache."""
import random
import subprocess
import sys

import pytest

from apiserver.detokenizer import IncrementalDetokenizer
from apiserver.renderer import Renderer, load_tokenizer
from apiserver.stop_strings import StopStrings
from enginecore.model_source import resolve_model

TEXTS = [
    "Paris is the capital of France.",
    "café — «la vie» 🥐🇫🇷 naïve Œuvre",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "  leading spaces,\ttabs\nand\r\nnewlines  ",
    "emoji with skin tone 👍🏽 and ZWJ family 👨‍👩‍👧",
    "a" * 50 + " " + "é" * 20,
]


@pytest.fixture(scope="module")
def renderer():
    return Renderer(load_tokenizer(resolve_model(None)))


def stream_deltas(renderer, ids, chunk_sizes, prompt=(1, 2), stop=(), **options):
    options["stop"] = StopStrings(list(stop))
    detok = IncrementalDetokenizer(renderer.tokenizer, list(prompt), **options)
    deltas, at = [], 0
    while at < len(ids):
        size = chunk_sizes[len(deltas) % len(chunk_sizes)]
        detok.add_tokens(ids[at:at + size])
        at += size
        done = detok.stop_reason is not None or at >= len(ids)
        deltas.append(detok.take_delta(final=done))
        if detok.stop_reason is not None:
            break
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [[1], [2, 3], [7]])
def test_streamed_text_equals_the_whole_decode(renderer, text, chunks):
    ids = renderer.encode(text, add_special_tokens=False)
    deltas, _ = stream_deltas(renderer, ids, chunks)
    assert "".join(deltas) == renderer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_special_tokens_are_skipped_or_kept(renderer):
    ids = renderer.encode("Hi", add_special_tokens=False) + [2]  # <|im_end|>
    assert "".join(stream_deltas(renderer, ids, [1])[0]) == "Hi"
    kept, _ = stream_deltas(renderer, ids, [1], skip_special_tokens=False)
    assert "".join(kept) == "Hi<|im_end|>"


@pytest.mark.parametrize("stop, expected", [
    (["capital"], "Paris is the "),
    ([" E", "zzz"], "Paris is the capital of France. It is known for the"),
    (["is", "Paris"], ""),  # the earliest match wins, whichever stop string it is
    (["France. It"], "Paris is the capital of "),  # across several tokens
    (["Eiffel", "known", "France"], "Paris is the capital of "),  # the earliest, of strings with other last letters
])
@pytest.mark.parametrize("chunks", [[1], [3]])
def test_stop_strings_never_leak(renderer, stop, expected, chunks):
    ids = renderer.encode("Paris is the capital of France. It is known for the Eiffel Tower.", add_special_tokens=False)
    deltas, detok = stream_deltas(renderer, ids, chunks, stop=stop)
    assert "".join(deltas) == expected
    assert detok.stop_reason in stop
    for delta in deltas[:-1]:
        assert not any(s in delta for s in stop)


def test_include_stop_string(renderer):
    ids = renderer.encode("Paris is the capital of France.", add_special_tokens=False)
    deltas, detok = stream_deltas(renderer, ids, [1], stop=["capital"], include_stop_str_in_output=True)
    assert "".join(deltas) == "Paris is the capital"


def test_stop_strings_find_what_a_search_for_each_finds():
    """StopStrings looks only for the strings whose last character the new text holds: it must find the same
    earliest match as a search for every string, and of two that begin at one place, the one given first."""
    rng = random.Random(7)
    for _ in range(3000):
        strings = list(dict.fromkeys("".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 5))))
        text = "".join(rng.choices("abcd", k=rng.randint(1, 12)))
        stops, start = StopStrings(strings), 0
        for end in range(1, len(text) + 1):  # the text grows a character at a time, as tokens add to it
            found = stops.first_in(text[:end], start)
            matches = [(at, s) for s in strings if (at := text[:end].find(s)) >= 0]
            expected = min(matches, key=lambda match: match[0]) if matches else None  # (the first given of a tie)
            assert found == expected, (strings, text[:end], found, expected)
            if found:
                break
            start = end


def test_tokens_after_a_stop_are_not_counted(renderer):
    ids = renderer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(renderer.tokenizer, [1], stop=StopStrings([" two"]))
    assert detok.add_tokens(ids) == 2  # "one", " two": the rest is ignored


def test_stop_strings_are_looked_for_only_after_min_tokens(renderer):
    ids = renderer.encode("one two three two four", add_special_tokens=False)  # one, two, three, two, four
    assert len(ids) == 5
    for min_tokens, used, text in ((0, 2, "one"), (1, 2, "one"), (2, 4, "one two three"), (3, 4, "one two three"),
                                   (4, 5, "one two three two four")):
        detok = IncrementalDetokenizer(renderer.tokenizer, [1], stop=StopStrings([" two"]), min_tokens=min_tokens)
        got = sum(detok.add_tokens(ids[i:i + 2]) for i in range(0, 5, 2) if detok.stop_reason is None)
        assert (got, detok.take_delta(final=True)) == (used, text), min_tokens
    straddling = IncrementalDetokenizer(renderer.tokenizer, [1], stop=StopStrings(["e two"]), min_tokens=1)
    assert straddling.add_tokens(ids) == 2 and straddling.take_delta(final=True) == "on"  # ends in token 2


def test_segment_cache_encodes_exactly_as_the_tokenizer(renderer):
    rng = random.Random(0)
    alphabet = list("ab é🥐<|>_\n ") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "system", "user"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert renderer.encode(text, add_special_tokens=False) == renderer.tokenizer.encode(text, add_special_tokens=False).ids


def test_the_api_server_never_imports_torch_or_transformers():
    # An API server stays small and starts fast: no torch, no transformers (it pulls torch in where torch is
    # installed), and neither of the other rooms' packages.
    code = (
        "import sys; import apiserver.process, apiserver.app, apiserver.server\n"
        "from apiserver.renderer import Renderer, load_tokenizer\n"
        "from enginecore.model_source import resolve_model\n"
        "Renderer(load_tokenizer(resolve_model(None)))\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'supervisor')]\n"
        "bad += [m for m in sys.modules if m.startswith('enginecore') and m != 'enginecore.model_source' and m != 'enginecore']\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
