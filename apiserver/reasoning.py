"""--reasoning-parser: models that think in `<think>…</think>` before they answer. The reasoning goes to
`reasoning_content` (of the message, or of each streamed delta), the rest to `content`; tool-call parsing and
structured outputs apply to what follows the reasoning.

Two of vLLM's parsers, by name:
- `deepseek_r1`: the output starts inside the reasoning (the template opens `<think>`, the output may repeat it)
  and the reasoning ends at `</think>`;
- `qwen3`: the output reasons only when it starts with `<think>`, or when the prompt ends with it (the chat
  template opened it, as Qwen3's does with `enable_thinking`). Otherwise all of it is content.
Reasoning cut short by max_tokens is reasoning: `content` stays empty.

Structured outputs wait for the reasoning: the grammar lets any text through up to `</think>`, then constrains.
Where the output has not started in the reasoning, the grammar lets it open `<think>` first only when the model's
vocabulary holds `<think>` as one token (a model trained to think): a model without it, masked to what may begin
the constrained answer, would take the `<` of a `<think>` it was never trained to close.
"""
from __future__ import annotations

from typing import NamedTuple

from apiserver.tool_parsers.base import held_prefix
from ipc.grammar import after_reasoning

START, END = "<think>", "</think>"


class Split(NamedTuple):
    reasoning: str
    content: str


class ReasoningParser:
    def __init__(self, name: str, start_is_one_token: bool):
        self.name = name
        self.always_reasons = name == "deepseek_r1"
        self._may_open = start_is_one_token

    def opened_by(self, prompt_tail: str, continued: str | None = None) -> bool:
        """Whether the output starts inside the reasoning, given the end of the prompt's text and, under
        continue_final_message, the text of the message it continues: one that opened the reasoning and has
        not closed it (`<think>Let me see`) goes on inside it."""
        if self.always_reasons or prompt_tail.rstrip().endswith(START):
            return True
        return continued is not None and continued.rfind(START) > continued.rfind(END)

    def constrain(self, grammar: str, opened: bool) -> str:
        """A structured output's grammar, applied after the reasoning (if any)."""
        if opened:
            return after_reasoning(grammar, END, None)
        return after_reasoning(grammar, END, START) if self._may_open else grammar


def split(text: str, opened: bool, final: bool) -> Split:
    """The reasoning and the content of `text` (a choice's output so far). Both only grow as the text does: until
    `final`, text that may still become a tag is held back."""
    lead = len(text) - len(text.lstrip())
    rest = text[lead:]
    if rest.startswith(START):
        at = lead + len(START)
    elif not final and START.startswith(rest):
        return Split("", "")  # may still become the tag
    elif opened:
        at = 0
    else:
        return Split("", text)
    end = text.find(END, at)
    if end < 0:
        return Split(text[at:] if final else text[at:len(text) - held_prefix(text, END)], "")
    return Split(text[at:end], text[end + len(END):].lstrip())


class ReasoningStream:
    """`split` for a streamed choice, delta by delta: what each delta adds to the reasoning and to the content,
    what `split` of the text so far would give, without keeping that text. Only what may still become a tag is
    held: split again after every delta, a long answer's text was copied and searched whole each time, its CPU
    growing with the square of its length."""

    __slots__ = ("_opened", "_phase", "_blank", "_held", "_content_begun")

    def __init__(self, opened: bool):
        self._opened = opened
        self._phase = "start"  # then "reasoning" or "content"
        self._blank: list[str] = []  # the output's leading whitespace, while it may still open <think>
        self._held = ""  # the start phase: what follows that whitespace; the reasoning: what may begin </think>
        self._content_begun = False  # the content after </think> goes out from its first non-whitespace

    def feed(self, text: str, final: bool) -> Split:
        if self._phase == "start":
            return self._start(text, final)
        if self._phase == "reasoning":
            return self._reasoning(text, final)
        return Split("", self._content(text))

    def _start(self, text: str, final: bool) -> Split:
        if not self._held:
            rest = text.lstrip()
            self._blank.append(text[:len(text) - len(rest)])
            text = rest
        head = self._held + text
        if head.startswith(START):
            self._phase = "reasoning"
            self._held = ""
            return self._reasoning(head[len(START):], final)
        if not final and START.startswith(head):
            self._held = head  # may still become the tag
            return Split("", "")
        whole = "".join(self._blank) + head
        self._blank, self._held = [], ""
        if self._opened:
            self._phase = "reasoning"
            return self._reasoning(whole, final)
        self._phase = "content"
        self._content_begun = True  # all of it is content, its leading whitespace too
        return Split("", whole)

    def _reasoning(self, text: str, final: bool) -> Split:
        text = self._held + text
        end = text.find(END)
        if end >= 0:
            self._phase = "content"
            self._held = ""
            return Split(text[:end], self._content(text[end + len(END):]))
        hold = 0 if final else held_prefix(text, END)
        self._held = text[len(text) - hold:] if hold else ""
        return Split(text[:len(text) - hold], "")

    def _content(self, text: str) -> str:
        if not self._content_begun:
            text = text.lstrip()
            self._content_begun = bool(text)
        return text
