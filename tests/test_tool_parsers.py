"""The tool-call parsers on canned model outputs: the whole answer, and the same text streamed in two pieces split
at every character and one character at a time, which must add up to the whole answer in OpenAI's delta shape."""
import json
import random
import time

import pytest

from apiserver.chat_output import OutputShape, StreamedMessage, message
from apiserver.tool_parsers import TOOL_PARSERS, ToolCallStream
from apiserver.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from apiserver.tool_parsers.json_scan import ScanMemo

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": "a \"quoted\" {brace} ]", "filters": {"tags": ["x", "y"], "n": -1.5e3, "ok": True, "none": None}}

CASES = [
    # (parser, model output, expected content, expected [(name, arguments)])
    ("hermes", "The weather? Let me check.", "The weather? Let me check.", []),
    ("hermes", 'I will call it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "I will call it.\n", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(NESTED) + '}\n</tool_call>',
     "", [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [("now", {})]),
    ("hermes", '<tool_call>\n{"arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}", "name": "get_weather"}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    ("hermes", "a < b and <tool_cal is not a tag", "a < b and <tool_cal is not a tag", []),
    ("hermes", "<tool_call> not json at all", "<tool_call> not json at all", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "search", "arguments": ' + json.dumps(NESTED) + '}',
     "", [("get_weather", WEATHER), ("search", NESTED)]),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", "{curly} is not a call", "{curly} is not a call", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", WEATHER)]),
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), search(query='a \"quoted\" {brace} ]', "
                 "filters={'tags': ['x', 'y'], 'n': -1.5e3, 'ok': True, 'none': None}), now()]",
     "", [("get_weather", WEATHER), ("search", NESTED), ("now", {})]),
    ("pythonic", "Sure, it is sunny.", "Sure, it is sunny.", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[search(query='it\\'s (a) \"test\"')]", "", [("search", {"query": "it's (a) \"test\""})]),
]


def _parser(name):
    return TOOL_PARSERS[name]()


def _whole(parser, text):
    parsed = parser.parse(text, final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _streamed(parser, pieces):
    stream = ToolCallStream(parser)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        for delta in deltas:
            index = delta["index"]
            if index not in calls:  # the first delta of a call: id, type, name, empty arguments
                assert index == len(calls)
                assert set(delta) == {"index", "id", "type", "function"} and delta["type"] == "function"
                assert delta["id"].startswith("call_") and delta["function"]["name"]
                calls[index] = [delta["function"]["name"], delta["function"]["arguments"]]
            else:  # then only pieces of the arguments
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                assert delta["function"]["arguments"]
                calls[index][1] += delta["function"]["arguments"]
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output(name, text, content, calls):
    assert _whole(_parser(name), text) == (content, calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_at_every_split(name, text, content, calls):
    for at in range(len(text) + 1):
        assert _streamed(_parser(name), [text[:at], text[at:]]) == (content, calls), at
    assert _streamed(_parser(name), list(text) or [""]) == (content, calls)


def test_streamed_arguments_are_the_whole_answers_text():
    """What a client concatenates is exactly the arguments string of the whole answer."""
    text = CASES[2][1]
    whole = _parser("hermes").parse(text, final=True).calls
    stream = ToolCallStream(_parser("hermes"))
    pieces: dict[int, str] = {}
    for i, ch in enumerate(text):
        for delta in stream.feed(ch, final=i == len(text) - 1)[1]:
            pieces[delta["index"]] = pieces.get(delta["index"], "") + delta["function"]["arguments"]
    assert [pieces[i] for i in sorted(pieces)] == [c.arguments for c in whole]


def test_forced_named_and_required():
    named = ' {"city": "Paris", "unit": "celsius"}'
    assert _whole(NamedCallParser("get_weather"), named) == ("", [("get_weather", WEATHER)])
    for at in range(len(named) + 1):
        assert _streamed(NamedCallParser("get_weather"), [named[:at], named[at:]]) == ("", [("get_weather", WEATHER)])
    required = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "search", "parameters": ' + json.dumps(NESTED) + "}]")
    expected = ("", [("get_weather", WEATHER), ("search", NESTED)])
    assert _whole(RequiredCallsParser(), required) == expected
    for at in range(len(required) + 1):
        assert _streamed(RequiredCallsParser(), [required[:at], required[at:]]) == expected
    assert _streamed(RequiredCallsParser(), list(required)) == expected


NOT_JSON = [
    # (parser, model output): what JSON does not take, where the scan alone would let it through
    ("hermes", '<tool_call>\n{"\\q": 1}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "\\q", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "\\q"}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"]}'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2}}\n</tool_call>'),
    # brackets and strings that close, values that do not decode: the scan alone took these for arguments
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a" 1, ,}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{not json"}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": Paris}}'),
    ("pythonic", "[f(a=[1, 2)]"),
    ("pythonic", "[f(1, 2), g()]"),
    # Python's parser raised MemoryError and RecursionError on these, out of the parser
    ("pythonic", "[f(a=" + "-" * 5000 + "1)]"),
    ("pythonic", "[f(a=" + "1+" * 5000 + "1)]"),
]


@pytest.mark.parametrize("name, text", NOT_JSON)
def test_what_is_not_json_is_content(name, text):
    """A tool call whose JSON is broken is content in a whole answer, and streamed it raises nothing (an escape such
    as \\q had raised json's own error out of the parser, which ended the answer). What a stream announced before
    the break stays sent, as in vLLM."""
    assert _whole(_parser(name), text) == (text, [])
    stream = ToolCallStream(_parser(name))
    for i, ch in enumerate(text):
        stream.feed(ch, final=i == len(text) - 1)


STREAMED_CASES = [(name, text) for name, text, _, _ in CASES] + NOT_JSON + [
    ("required", '[{"name": "search", "parameters": ' + json.dumps(NESTED) + '}, {"name": "now", "parameters": {}}]'),
]


@pytest.mark.parametrize("name, text", STREAMED_CASES)
def test_parsing_with_the_memo_of_shorter_texts_is_parsing_afresh(name, text):
    """A streamed choice's text is parsed again after every delta, with what the scans of its shorter versions
    found (json_scan.ScanMemo): at every length, in pieces of any size, it must parse as a fresh parse does."""
    for seed in range(4):
        parser = RequiredCallsParser() if name == "required" else _parser(name)
        memo, at, rng = ScanMemo(), 0, random.Random(seed)
        while at < len(text):
            at = min(len(text), at + rng.choice([1, 1, 2, 3, 7]))
            for final in (False, True) if at == len(text) else (False,):
                assert parser.parse(text[:at], final, memo) == parser.parse(text[:at], final), (seed, at)


LONG_CALLS = {
    "hermes": lambda lines: '<tool_call>\n{"name": "write", "arguments": ' + json.dumps(
        {"path": "a.py", "content": "def f(x):\n    return [x, {\"y\": 2}]\n" * lines}) + '}\n</tool_call>',
    "pythonic": lambda lines: "[f(a=[" + ", ".join(f"({i}, 'x')" for i in range(lines * 4)) + "]), g()]",
}


@pytest.mark.parametrize("name", LONG_CALLS)
def test_a_long_streamed_call_costs_each_delta_about_its_own_length(name):
    """A 40 KB file written through a tool call, four characters a delta: parsed whole after each delta it took
    8.5 s of the API server's CPU (a pythonic list of 24 KB: 5.4 s), growing with the square of the length; the
    tenfold longer call must not cost a hundred times as much."""
    def seconds(lines: int) -> float:
        text = LONG_CALLS[name](lines)
        stream = ToolCallStream(_parser(name))
        started = time.process_time()
        for i in range(0, len(text), 4):
            stream.feed(text[i:i + 4], False)
        took = time.process_time() - started
        assert stream.parser.parse(stream.text, True).calls[0].complete
        return took

    short, long = min(seconds(100) for _ in range(3)), min(seconds(1000) for _ in range(3))
    assert long < 30 * short, f"{long:.3f} s for 10x the text of {short:.3f} s"


class _KeepingAll:
    """A parser whose stream keeps the whole text (as every stream did): what `settled` lets a stream drop must
    change nothing it sends."""

    def __init__(self, parser):
        self.parse = parser.parse

    def settled(self, text):
        return 0


FRAGMENTS = {
    "hermes": ["Sure", " ", "\n", "<", "<tool", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": [1, "]"]}}',
               '{"name": "g"', ', "arguments": {}}', "{", '"', "x" * 30],
    "llama3_json": [" ", "\n", "<|python", "<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', ";", "{", "}",
                    "Paris", '"', "x" * 30],
    "pythonic": [" ", "\n", "[", "]", "f(a=1)", ", ", "g(", ")", "'s'", "Sure", "(", "x" * 30],
}


@pytest.mark.parametrize("name", FRAGMENTS)
def test_a_stream_that_drops_settled_content_sends_what_one_keeping_all_sends(name):
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        lean, keeping = ToolCallStream(_parser(name)), ToolCallStream(_KeepingAll(_parser(name)))
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            got, want = lean.feed(piece, final), keeping.feed(piece, final)
            strip = lambda deltas: [{k: v for k, v in d.items() if k != "id"} for d in deltas]  # noqa: E731
            assert (got[0], strip(got[1])) == (want[0], strip(want[1])), (seed, pieces, i)


@pytest.mark.parametrize("name", FRAGMENTS)
def test_long_streamed_content_costs_each_delta_about_its_own_length(name):
    """A long answer without calls, from a model that has tools: the stream kept its whole text and the parser
    searched it after each delta (hermes: 50 us a delta at 160 KB, 6 us at 5 KB); tenfold the text must not cost
    a hundred times as much."""
    def seconds(kb: int) -> float:
        text = "Sure: the quick brown fox [jumps] {over} the <lazy> dog; " * (kb * 1024 // 56)
        stream = ToolCallStream(_parser(name))
        started = time.process_time()
        sent = "".join(stream.feed(text[i:i + 4], False)[0] for i in range(0, len(text), 4))
        took = time.process_time() - started
        assert sent + stream.feed("", True)[0] == text
        return took

    short, long = min(seconds(16) for _ in range(3)), min(seconds(160) for _ in range(3))
    assert long < 30 * short, f"{long:.3f} s for 10x the text of {short:.3f} s"


@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("name", FRAGMENTS)
def test_a_streamed_message_adds_up_to_the_whole_answer(name, reasoning):
    """Random outputs in random pieces, through the stream's reasoning and tool-call parsing: its content,
    reasoning and calls are the whole answer's (a stream may also keep a call it announced before its text broke,
    as vLLM's does). An output that ended at `<tool_call>` was content whole, and lost the tag streamed."""
    fragments = FRAGMENTS[name] + ["<think>", "</think>", "\n\n"]
    for seed in range(600):
        rng = random.Random(seed)
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 10)))
        shape = OutputShape(reasoning, False, _parser(name))
        whole, _ = message(text, shape, "stop")
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))) if len(text) > 1 else []
        bounds = [0] + cuts + [len(text)]
        streamed, got, calls = StreamedMessage(shape), {"content": "", "reasoning_content": ""}, {}
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            fields = streamed.feed(text[a:b], i == len(bounds) - 2)
            for key in got:
                got[key] += fields.get(key, "")
            for delta in fields.get("tool_calls", []):
                call = calls.setdefault(delta["index"], [delta["function"].get("name"), ""])
                call[1] += delta["function"]["arguments"]
        whole_calls = [[c["function"]["name"], c["function"]["arguments"]] for c in whole.get("tool_calls", [])]
        assert (got["content"] or None) == (whole["content"] or None), (seed, text, cuts)
        assert (got["reasoning_content"] or None) == whole.get("reasoning_content"), (seed, text, cuts)
        assert list(calls.values())[:len(whole_calls)] == whole_calls, (seed, text, cuts)
