"""Tool-call parsers by their vLLM names (`--tool-call-parser`), and the parser a request's tool_choice needs."""
from __future__ import annotations

from apiserver.tool_parsers.base import ToolCallStream, ToolParser, tool_calls_json
from apiserver.tool_parsers.hermes import HermesParser
from apiserver.tool_parsers.llama3_json import Llama3JsonParser
from apiserver.tool_parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}

__all__ = ["TOOL_PARSERS", "ToolCallStream", "ToolParser", "tool_calls_json"]
