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

import functools
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ipc.messages import error_summary

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from llguidance._lib import JsonCompileOptions

# Everything between the start of the output and the end of the reasoning: the shortest text that ends with the
# tag (a lazy lexeme stops at the first match).
_REASONING_RULES = 'reasoning[lazy]: /(?s:.*){end}/\nWS: /[ \\t\\r\\n]*/\n'


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong with it."""


# How an engine's RequestOutput.error starts when the request's grammar failed there (it did not compile against
# the tokenizer, or its matcher hit one of llguidance's limits on the way): the request's own fault, which an API
# server answers as a 400 like the grammars its own check refuses, not as an engine failure (a 500).
ENGINE_GRAMMAR_ERROR = "the structured output grammar "


def engine_error(what: str) -> str:
    """An engine's error for a request whose grammar failed: `what` says how ("does not compile: ...")."""
    return ENGINE_GRAMMAR_ERROR + what


def is_engine_error(error: str | None) -> bool:
    return error is not None and error.startswith(ENGINE_GRAMMAR_ERROR)


def _matcher() -> type[LLMatcher]:
    from llguidance import LLMatcher  # here, not at the top: a process that never constrains an output never loads it

    return LLMatcher


_TOO_DEEP = "the schema is nested too deeply"


def json_schema_grammar(schema: dict[str, Any], any_whitespace: bool = True) -> str:
    """Output that is one JSON value valid against `schema`. Objects whose schema lists properties and says nothing
    of others get none beyond them (what xgrammar, vLLM's default backend, does, and OpenAI's strict mode asks):
    still valid against the schema, and a small model does not wander off into keys of its own. any_whitespace
    False: no whitespace between tokens.

    Keywords llguidance does not enforce (`uniqueItems`, which pydantic writes for every set, `format: binary`,
    `not`, `if`/`then`, `propertyNames`, ...) are left out of the constraint (lenient), as vLLM's guidance backend
    leaves them: refusing them refused the schemas of ordinary pydantic models and whole tool lists. Output still
    follows every keyword that is enforced; a schema that is wrong (an unknown type, a bound that is no number)
    is still refused."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    options: JsonCompileOptions = {"lenient": True}
    if not any_whitespace:
        options["whitespace_flexible"] = False
    try:
        return _matcher().grammar_from_json_schema(json.dumps(closed_objects(schema)), overrides=options)
    except RecursionError:
        raise GrammarError(_TOO_DEEP) from None
    except (ValueError, TypeError) as exc:  # whatever the client sent, a 400, never a 500
        raise GrammarError(str(exc) or type(exc).__name__) from None


def json_object_grammar(any_whitespace: bool = True) -> str:
    return json_schema_grammar({"type": "object"}, any_whitespace=any_whitespace)


def regex_grammar(pattern: str) -> str:
    return _matcher().grammar_from_regex(pattern)


# A choice's characters, one level a character; the key "" marks where a choice ends.
Trie = dict[str, "Trie"]


def choice_grammar(choices: list[str], max_choices: int | None = None) -> str:
    """Exactly one of `choices`, as one regex lexeme whose alternatives share their common prefixes (a trie):
    llguidance refuses a Lark rule of 2,000 alternatives or more (its Earley row limit, nested rules or not),
    while the trie's lexer stays small (10,000 labels compile in tens of milliseconds). `max_choices`: a longer
    list is a GrammarError."""
    if not choices:
        raise GrammarError("the list of choices is empty")
    if max_choices is not None and len(choices) > max_choices:
        raise GrammarError(f"{len(choices):,} choices; at most {max_choices:,} are served "
                           f"(--max-structured-output-choices)")
    trie: Trie = {}
    for choice in choices:
        node = trie
        for ch in choice:
            node = node.setdefault(ch, {})
        node[""] = {}  # a choice ends here
    regex = _trie_regex(trie)
    return _matcher().grammar_from_lark(f"start: /{regex}/" if regex else 'start: ""')


def _trie_regex(node: Trie) -> str:
    """The regex of the strings below `node` (iteratively: a choice may be thousands of characters long)."""
    # Post-order walk: each node's regex once its children's are known.
    done: dict[int, str] = {}
    stack: list[tuple[Trie, bool]] = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if not expanded:
            stack.append((current, True))
            stack.extend((sub, False) for ch, sub in current.items() if ch)
            continue
        alternatives = [_lark_regex_literal(ch) + done.pop(id(sub)) for ch, sub in current.items() if ch]
        regex = "(?:" + "|".join(alternatives) + ")" if len(alternatives) > 1 else "".join(alternatives)
        if "" in current and regex:  # a choice ends here and others go on
            regex = f"(?:{regex})?"
        done[id(current)] = regex
    return done[id(node)]


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's, what vLLM's `grammar` takes)."""
    try:
        from llguidance import grammar_from  # lazily, as in _matcher

        return grammar_from("grammar", text)
    except (ValueError, TypeError, RecursionError) as exc:  # the GBNF converter is Python: it may raise anything
        raise GrammarError(str(exc) or type(exc).__name__) from None


def from_constraint(kind: str, value: Any, any_whitespace: bool = True, max_choices: int | None = None) -> str:
    """The grammar of one constraint by its name, as the API's extras (and the gRPC protocol's constraints) name
    them: `json` (a schema, as an object or its JSON text), `json_object`, `regex`, `choice` (a list of strings,
    at most `max_choices`), `grammar` (Lark or GBNF). GrammarError for anything that cannot be one."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise GrammarError(_TOO_DEEP) from None
            except ValueError as exc:
                raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        return json_schema_grammar(value, any_whitespace)
    if kind == "json_object":
        return json_object_grammar(any_whitespace)
    if kind == "regex" and isinstance(value, str):
        return regex_grammar(value)
    if kind == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        return choice_grammar(value, max_choices)
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
    """GrammarError naming the problem, unless `grammar` compiles and can take its first step. Needs no
    tokenizer: cheap (a millisecond or so for a schema of a few properties), but a client's grammar can take
    seconds, or crash llguidance: an API server calls it in a process of its own (apiserver/grammar_checker.py)."""
    error = _check(grammar)
    if error:
        raise GrammarError(error)


def _check(grammar: str) -> str | None:
    matcher = _matcher()
    try:
        error = matcher.validate_grammar(grammar, limits=parser_limits())
    except (ValueError, TypeError) as exc:
        error = str(exc) or type(exc).__name__
    return short_reason(error) if error else _first_step_error(grammar)


def _first_step_error(grammar: str) -> str | None:
    """Why `grammar` fails at its first step, or None. validate_grammar does not build the lexer (llguidance
    builds it lazily, step by step), so a grammar can pass it and still fail in the engine at once: one that
    allows no output at all (a JSON schema `{"$ref": "#"}`), or a regex past the lexer's limits (`b{888888}`).
    A matcher over a 257-token byte vocabulary computes the first mask and takes the first allowed byte: what
    the engine does first, with llguidance's same limits; only a grammar's own faults fail it, whatever the
    model's tokenizer. A grammar that names special tokens cannot be built over bytes: the engine judges it."""
    matcher = _matcher()(_byte_tokenizer(), grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        return None
    mask = matcher.compute_bitmask()
    if not matcher.is_error():
        allowed = [b for b in range(256) if mask[b // 8] >> (b % 8) & 1]
        if not allowed and not matcher.is_accepting():
            return "the grammar allows no output at all"
        if allowed:
            matcher.consume_token(allowed[0])
    return short_reason(matcher.get_error()) if matcher.is_error() else None


def short_reason(error: str) -> str:
    """llguidance's error as a client may read it: on one line, without the parser state and the grammar it may
    append (verbose errors, which parser_limits() turns off; a matcher's errors still end in a marker),
    bounded, and in words where llguidance gives a name."""
    text = re.split(r"<state>|<non-verbose/>|<grammar>", error, maxsplit=1)[0]
    text = " ".join(text.split())
    return error_summary(_NO_EXTENSION.get(text, text))


# llguidance's names for what a client should be told in words.
_NO_EXTENSION = {"NoExtensionBias": "the grammar allows no output at all (an unsatisfiable schema?)"}


@functools.cache
def parser_limits() -> LLParserLimits:
    """llguidance's default limits, but errors without the parser state and the grammar (which can run to tens
    of KB, the request's whole schema included): the same limits in the API servers' check and in the engine."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_Bytes()))


class _Bytes:
    """A vocabulary of the 256 bytes and an EOS, in the shape llguidance's TokenizerWrapper reads."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists properties and says nothing of others gets
    additionalProperties false, through every keyword that holds schemas (but allOf: properties spread over its
    members would make each member refuse the others', and the whole refuse everything)."""
    if not isinstance(schema, dict):
        return schema
    closed = _subschemas_mapped(schema, closed_objects, _SCHEMA_LISTS)
    if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def refs_rebased(schema: Any, pointer: str) -> Any:
    """A copy of `schema`, to be placed at `pointer` ("/items/anyOf/0", escaped) in a larger schema, whose own
    references ("#", "#/$defs/City") point where its parts will then be: as it came, "#/$defs/City" in a tool's
    parameters would be looked for at the root of the schema that forces the calls, and not found (a pydantic
    model's schema refers to its nested models so)."""
    if not isinstance(schema, dict):
        return schema
    rebased = _subschemas_mapped(schema, lambda sub: refs_rebased(sub, pointer), _SCHEMA_LISTS + ("allOf",))
    ref = rebased.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        rebased["$ref"] = "#" + pointer + ref[1:]
    return rebased


def _subschemas_mapped(schema: dict[str, Any], mapped: Callable[[Any], Any], lists: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `schema` with each schema it holds (under the keywords that hold schemas) `mapped`."""
    copy = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(copy.get(key), dict):
            copy[key] = {name: mapped(sub) for name, sub in copy[key].items()}
    for key in lists:
        if isinstance(copy.get(key), list):
            copy[key] = [mapped(sub) for sub in copy[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(copy.get(key), dict):
            copy[key] = mapped(copy[key])
    return copy


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "additionalItems")


def _lark_regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (Rust regex syntax, plus the delimiter); control characters
    (a newline would end the Lark line) as their code point."""
    return "".join("\\" + ch if ch in _REGEX_META else f"\\x{{{ord(ch):x}}}" if ord(ch) < 32 or ch == "\x7f" else ch
                   for ch in text)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")
