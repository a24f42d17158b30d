"""Structured outputs as they travel to the engine: one llguidance grammar, as its JSON text.

An API server turns what a request asks for (a JSON schema, any JSON object, a regex, a list of choices, a Lark or
GBNF grammar) into this text and checks it (GrammarError: the request is refused before anything is queued). The
text is plain data in SamplingParams.grammar; the engine compiles it against its tokenizer, caches the compiled
form by this text, and masks every sampled token by it (enginecore/structured_output.py). Any front end (the HTTP
API servers, a gRPC one) maps its own constraint fields through the same functions, so the engine sees one form.

llguidance (not xgrammar): its wheel brings nothing else, where xgrammar's pulls triton and a TVM runtime; it
needs no torch, so the API servers can check grammars without it; it compiles lazily (milliseconds, no up-front
pass over the vocabulary per grammar) and computes a mask in microseconds on the CPU.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from llguidance._lib import JsonCompileOptions

# Everything between the start of the output and the end of the reasoning: the shortest text that ends with the
# tag (a lazy lexeme stops at the first match).
_REASONING_RULES = 'reasoning[lazy]: /(?s:.*){end}/\nWS: /[ \\t\\r\\n]*/\n'


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong with it."""


def _matcher() -> type[LLMatcher]:
    from llguidance import LLMatcher  # here, not at the top: a process that never constrains an output never loads it

    return LLMatcher


def json_schema_grammar(schema: dict[str, Any], any_whitespace: bool = True) -> str:
    """Output that is one JSON value valid against `schema`. Objects whose schema lists properties and says nothing
    of others get none beyond them (what xgrammar, vLLM's default backend, does, and OpenAI's strict mode asks):
    still valid against the schema, and a small model does not wander off into keys of its own. any_whitespace
    False: no whitespace between tokens."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    schema = closed_objects(schema)
    options: JsonCompileOptions | None = None if any_whitespace else {"whitespace_flexible": False}
    try:
        return _matcher().grammar_from_json_schema(json.dumps(schema), overrides=options)
    except (ValueError, TypeError, RecursionError) as exc:  # whatever the client sent, a 400, never a 500
        raise GrammarError(str(exc) or type(exc).__name__) from None


def json_object_grammar(any_whitespace: bool = True) -> str:
    return json_schema_grammar({"type": "object"}, any_whitespace=any_whitespace)


def regex_grammar(pattern: str) -> str:
    return _matcher().grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    if not choices:
        raise GrammarError("the list of choices is empty")
    return _matcher().grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's, what vLLM's `grammar` takes)."""
    try:
        from llguidance import grammar_from  # lazily, as in _matcher

        return grammar_from("grammar", text)
    except (ValueError, TypeError, RecursionError) as exc:  # the GBNF converter is Python: it may raise anything
        raise GrammarError(str(exc) or type(exc).__name__) from None


def from_constraint(kind: str, value: Any, any_whitespace: bool = True) -> str:
    """The grammar of one constraint by its name, as the API's extras (and the gRPC protocol's constraints) name
    them: `json` (a schema, as an object or its JSON text), `json_object`, `regex`, `choice` (a list of strings),
    `grammar` (Lark or GBNF). GrammarError for anything that cannot be one."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        return json_schema_grammar(value, any_whitespace)
    if kind == "json_object":
        return json_object_grammar(any_whitespace)
    if kind == "regex" and isinstance(value, str):
        return regex_grammar(value)
    if kind == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        return choice_grammar(value)
    if kind == "grammar" and isinstance(value, str):
        return lark_grammar(value)
    raise GrammarError(f"not a constraint: {kind!r}")


def after_reasoning(grammar: str, end_tag: str, start_tag: str | None) -> str:
    """`grammar` applied after the model's reasoning: free text up to `end_tag` first. With `start_tag` the
    output may skip reasoning, or reason between the two tags; without it the output starts inside the reasoning
    (the prompt opened it)."""
    inner = json.loads(grammar)["grammars"]
    inner[0] = {**inner[0], "name": "constrained"}
    end = _lark_regex_literal(end_tag)
    if start_tag is None:
        outer = "start: reasoning WS @constrained\n"
    else:
        outer = f"start: ({json.dumps(start_tag)} reasoning WS)? @constrained\n"
    outer += _REASONING_RULES.format(end=end)
    return json.dumps({"grammars": [{"lark_grammar": outer}, *inner]})


def check(grammar: str) -> None:
    """GrammarError naming the problem, unless `grammar` compiles. Needs no tokenizer: cheap (a millisecond or
    so for a schema of a few properties)."""
    matcher = _matcher()
    try:
        error = matcher.validate_grammar(grammar)
    except (ValueError, TypeError) as exc:
        error = str(exc) or type(exc).__name__
    if error:
        raise GrammarError(error.strip())


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists properties and says nothing of others gets
    additionalProperties false, through every keyword that holds schemas."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Not allOf: properties spread over its members would make each member refuse the others' (and the whole refuse
# everything).
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "additionalItems")


def _lark_regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (Rust regex syntax, plus the delimiter)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")
