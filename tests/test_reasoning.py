"""Reasoning (`--reasoning-parser`) on canned outputs, whole and split at every character; structured outputs after
the reasoning, checked with llguidance's own matcher on token sequences; the token mask's two unpackers."""
import functools
import json
import random
import time

import llguidance
import numpy as np
import pytest
import torch

from apiserver.chat_output import OutputShape, StreamedMessage, message
from apiserver.protocol import ChatCompletionRequest
from apiserver.reasoning import ReasoningParser, ReasoningStream, split
from apiserver.tool_choice import tool_plan
from apiserver.tool_parsers.hermes import HermesParser
from enginecore.model_source import resolve_model
from enginecore.structured_output import TokenMask
from ipc import grammar as grammars
from ipc.config import ServeConfig

CASES = [
    # (output, the prompt opened <think>, reasoning, content)
    ("<think>Seventeen has no divisor.</think>\n\nYes, it is prime.", False, "Seventeen has no divisor.", "Yes, it is prime."),
    ("Seventeen has no divisor.</think>Yes.", True, "Seventeen has no divisor.", "Yes."),
    ("<think>a < b, and </thi is not the end", False, "a < b, and </thi is not the end", ""),
    ("Plain answer, no thinking.", False, "", "Plain answer, no thinking."),
    ("Still thinking when max_tokens", True, "Still thinking when max_tokens", ""),
    ("  <think>x</think>y", True, "x", "y"),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_split_whole_and_streamed(text, opened, reasoning, content):
    assert split(text, opened, final=True) == (reasoning, content)
    shape = OutputShape(True, opened, None)
    for at in range(len(text) + 1):
        streamed = StreamedMessage(shape)
        got = {"reasoning": "", "reasoning_content": "", "content": ""}
        for piece, final in ((text[:at], False), (text[at:], True)):
            for key, value in streamed.feed(piece, final).items():
                got[key] += value
        assert (got["reasoning"], got["reasoning_content"], got["content"]) == (reasoning, reasoning, content), at


REASONING_FRAGMENTS = ["<think>", "</think>", "<th", "</thi", "<", "/", " ", "\n", "\u3000", "x", "Yes.", "think>"]


@pytest.mark.parametrize("opened", [False, True])
def test_a_reasoning_stream_sends_what_splitting_the_text_so_far_gives(opened):
    """ReasoningStream keeps only what may still become a tag; after every delta, what it sent in all must be
    what `split` of the whole text so far gives."""
    for seed in range(500):
        rng = random.Random(seed)
        text = "".join(rng.choice(REASONING_FRAGMENTS) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        bounds = [0] + cuts + [len(text)]
        stream, reasoning, content = ReasoningStream(opened), "", ""
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            final = b == len(text) and i == len(bounds) - 2
            r, c = stream.feed(text[a:b], final)
            reasoning, content = reasoning + r, content + c
            assert (reasoning, content) == split(text[:b], opened, final), (seed, text, b)


@pytest.mark.parametrize("opened", [False, True])
def test_a_long_streamed_answer_with_reasoning_and_tools_costs_each_delta_about_its_own_length(opened):
    """The streamed message kept the choice's whole text and split it after every delta, and the tool-call stream
    its own copy: tenfold the text must not cost a hundred times as much."""
    def seconds(kb: int) -> float:
        prose = "the quick brown fox <jumps> over the lazy dog; " * (kb * 1024 // 47)
        text = ("" if opened else "<think>") + prose + "</think>\n\n" + prose
        streamed = StreamedMessage(OutputShape(True, opened, HermesParser()))
        started = time.process_time()
        for i in range(0, len(text), 4):
            streamed.feed(text[i:i + 4], False)
        return time.process_time() - started

    short, long = min(seconds(8) for _ in range(3)), min(seconds(80) for _ in range(3))
    assert long < 30 * short, f"{long:.3f} s for 10x the text of {short:.3f} s"


def test_message_with_reasoning_then_a_tool_call():
    text = '<think>Need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msg, finish = message(text, OutputShape(True, False, HermesParser()), "stop")
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None and finish == "tool_calls"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_deepseek_r1_always_starts_in_reasoning_qwen3_when_the_prompt_opens_it():
    assert ReasoningParser("deepseek_r1", False).opened_by("<|im_start|>assistant\n")
    assert ReasoningParser("qwen3", False).opened_by("<|im_start|>assistant\n<think>\n")
    assert not ReasoningParser("qwen3", False).opened_by("<|im_start|>assistant\n")
    # Continuing a message (continue_final_message) that opened the reasoning and has not closed it.
    qwen3 = ReasoningParser("qwen3", False)
    assert qwen3.opened_by("Let me see", continued="<think>Let me see")
    assert not qwen3.opened_by("The answer", continued="<think>hm</think>The answer")
    assert not qwen3.opened_by("Let me see", continued="Let me see")
    assert not qwen3.opened_by("<think>x", continued=None)  # a prompt's earlier text is not the output's start


@functools.lru_cache(maxsize=1)
def _tokenizers():
    from tokenizers import Tokenizer

    path = resolve_model(None) + "/tokenizer.json"
    text = open(path).read()
    return llguidance.LLTokenizer(text), Tokenizer.from_str(text)


def _accepts(grammar: str, text: str) -> bool:
    llg, tokenizer = _tokenizers()
    matcher = llguidance.LLMatcher(llg, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_structured_output_applies_after_the_reasoning():
    schema = grammars.json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    opened = ReasoningParser("qwen3", True).constrain(schema, opened=True)
    assert _accepts(opened, 'free text, even {"a": "x"} </think>\n{"a": 1}')
    assert not _accepts(opened, '{"a": 1}')  # the reasoning must end first
    assert not _accepts(opened, 'thoughts</think>{"a": "x"}')  # and then the schema holds
    may_open = ReasoningParser("qwen3", True).constrain(schema, opened=False)
    assert _accepts(may_open, '{"a": 1}') and _accepts(may_open, '<think>hm</think>{"a": 2}')
    assert not _accepts(may_open, 'hm</think>{"a": 2}')
    # A model without <think> as one token is not offered the tag (it would take the "<" and never close it).
    assert ReasoningParser("qwen3", False).constrain(schema, opened=False) == schema


def test_a_forced_calls_schema_keeps_each_tools_own_references():
    """`tool_choice: required` puts each tool's parameters deep in the schema that forces the calls: their "#"
    (the parameters themselves: a tree of nodes) must not mean that schema's root (an array of calls)."""
    node = {"type": "object", "properties": {"n": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["n", "kids"]}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                    tools=[{"type": "function", "function": {"name": "tree", "parameters": node}}])
    grammar = grammars.json_schema_grammar(tool_plan(request, ServeConfig(model="m")).schema)
    assert _accepts(grammar, '[{"name": "tree", "parameters": {"n": 1, "kids": [{"n": 2, "kids": []}]}}]')
    assert not _accepts(grammar, '[{"name": "tree", "parameters": {"n": 1, "kids": [[{"name": "tree", '
                                 '"parameters": {"n": 2, "kids": []}}]]}}]')


def test_token_mask_unpacks_alike_on_cpu_and_on_an_accelerator():
    """The accelerator's unpacking (torch shifts) computed on the CPU: the same barred tokens as numpy's."""
    bits = np.random.default_rng(0).integers(-2**31, 2**31, size=(3, 40), dtype=np.int64).astype(np.int32)
    mask = TokenMask([0, 2, 5], bits, 1270)
    assert torch.equal(mask.barred_on_cpu(), mask.barred_on(torch.device("cpu")))
    logits = torch.zeros(6, 1270)
    mask.apply(logits)
    expected = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :1270] == 0)
    assert torch.equal(torch.isinf(logits[[0, 2, 5]]), expected) and not torch.isinf(logits[[1, 3, 4]]).any()
