"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: what the chat template sees, the grammar
that forces a call, and the parser that reads the calls back.

- `none`: the template still sees the tools (as vLLM renders them); the output is plain content.
- `auto` (the default when tools are given): the model decides; the `--tool-call-parser` finds the calls in its
  text (the first only with `parallel_tool_calls: false`). It needs `--enable-auto-tool-choice` (a 400 otherwise,
  as in vLLM).
- `required`: structured outputs force a JSON array of calls `{"name", "parameters"}`, each valid against its
  function's schema (one call only with `parallel_tool_calls: false`).
- a named function: structured outputs force that function's arguments, valid against its schema.
- `allowed_tools` (`{"mode": "auto" | "required", "tools": [named functions]}`): the request's tools cut down to
  those named, then `mode` as above. The chat template sees only the allowed ones, so that with `auto` the model
  does not call one it may not (OpenAI keeps the whole list in the prompt, for its prompt cache; here a prompt
  cannot hide a tool from the model).
"""
from __future__ import annotations

from typing import NamedTuple

import orjson

from apiserver.errors import InvalidRequest
from apiserver.protocol import AllowedTools, AllowedToolsChoice
from apiserver.tool_parsers import TOOL_PARSERS, ToolParser
from apiserver.tool_parsers.base import Parsed
from apiserver.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from apiserver.tool_parsers.json_scan import ScanMemo
from ipc import grammar as grammars
from ipc.config import ServeConfig


class ToolPlan(NamedTuple):
    template_tools: list[dict] | None  # what the chat template gets as `tools`
    schema: dict | None  # the JSON schema that forces the calls (required, named; see structured_outputs.py)
    parser: ToolParser | None  # reading them back


NO_TOOLS = ToolPlan(None, None, None)


def tool_plan(request, config: ServeConfig) -> ToolPlan:
    tools = request.tools
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("`tool_choice` needs `tools`.", param="tool_choice")
        return NO_TOOLS
    functions = {tool.function.name: tool.function for tool in tools}
    if len(functions) != len(tools):
        raise InvalidRequest("Two tools have the same function name.", param="tools")
    if isinstance(choice, AllowedToolsChoice):
        tools = _allowed(tools, choice.allowed_tools)
        functions = {tool.function.name: tool.function for tool in tools}
        choice = choice.allowed_tools.mode
    template_tools = tools_for_template(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if choice == "auto":
        if not config.enable_auto_tool_choice or not config.tool_call_parser:
            raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                 "set.", param="tool_choice")
        parser = TOOL_PARSERS[config.tool_call_parser]()
        return ToolPlan(template_tools, None, FirstCallOnly(parser) if request.parallel_tool_calls is False else parser)
    if choice == "required":
        calls = {"anyOf": [_call_schema(f, f"/items/anyOf/{i}") for i, f in enumerate(functions.values())]}
        array = {"type": "array", "minItems": 1, "items": calls}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan(template_tools, array, RequiredCallsParser())
    name = choice.function.name
    if name not in functions:
        raise InvalidRequest(f"`tool_choice` names the function {_shown(name)}, which is not among the tools.",
                             param="tool_choice")
    return ToolPlan(template_tools, _parameters(functions[name]), NamedCallParser(name))


def _allowed(tools: list, allowed: AllowedTools) -> list:
    """The tools `allowed` names, in the request's order."""
    names = {choice.function.name for choice in allowed.tools}
    known = {tool.function.name for tool in tools}
    unknown = sorted(names - known)
    if unknown:
        raise InvalidRequest(f"`tool_choice.allowed_tools` names the function {_shown(unknown[0])}, which is not "
                             "among the tools.", param="tool_choice")
    return [tool for tool in tools if tool.function.name in names]


def _shown(name: str) -> str:
    """A function name from the request, as an error quotes it (a tool's name has at most 64 characters; what the
    choice names, anything)."""
    return repr(name) if len(name) <= 64 else f"{name[:64]!r}..."


def tools_for_template(tools) -> list[dict]:
    """A request's `tools` as the chat template gets them (a chat request's, and /tokenize's)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


class FirstCallOnly(ToolParser):
    """`auto` with `parallel_tool_calls: false`: the model may still write several calls; the first is the
    answer's only one (OpenAI promises at most one), the others are dropped, not sent as content."""

    def __init__(self, parser: ToolParser):
        self.parser = parser

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        content, calls = self.parser.parse(text, final, memo)
        return Parsed(content, calls[:1])

    def settled(self, text: str) -> int | None:
        return self.parser.settled(text)


def _call_schema(function, pointer: str) -> dict:
    """A call of `function`, as the schema at `pointer` in the one that forces the calls."""
    parameters = _parameters(function)
    if _may_refer(parameters):
        parameters = grammars.refs_rebased(parameters, pointer + "/properties/parameters")
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _parameters(function) -> dict:
    """The schema a forced call's arguments follow: always an object's (OpenAI's arguments are one, and clients
    call `fn(**json.loads(arguments))`), also where `parameters` leaves the type out: `{}` let the model answer
    `false`."""
    parameters = function.parameters
    if parameters is None:
        return {"type": "object", "properties": {}}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def _may_refer(schema: dict) -> bool:
    """Whether `schema` may hold a "$ref": its JSON text, written in C, is searched (the walk that rebases
    references costs about 3 us per node of the schema, in the event loop)."""
    try:
        return b'"$ref"' in orjson.dumps(schema)
    except orjson.JSONEncodeError:  # an integer past 64 bits
        return True
