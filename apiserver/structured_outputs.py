"""A request's structured output, as the grammar the engine will mask its tokens by (ipc/grammar.py), checked
here: an invalid schema, regex or grammar is a 400 that names the problem, before anything is queued. The
grammars of `structured_outputs` are built, and every grammar is checked, by the server's GrammarChecker, in a
process of its own (apiserver/grammar_checker.py); a JSON schema's is built here when it is small (see
`schema_grammar`).

The fields, on both chat and completions:
- `response_format`: `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` (OpenAI's); `{"type": "text"}` constrains nothing;
- `structured_outputs` (vLLM's extras): one of `json` (a schema), `json_object`, `regex`, `choice`, `grammar`
  (Lark or GBNF), with `disable_any_whitespace`. An object schema that lists its properties gets no others unless it
  says so (ipc/grammar.py), so `strict` and `disable_additional_properties` are accepted and change nothing.
"""
from __future__ import annotations

import orjson

from apiserver.errors import InvalidRequest
from apiserver.grammar_checker import GrammarChecker
from ipc import grammar as grammars

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
INLINE_SCHEMA_BYTES = 64 * 1024  # about 10 ms of the event loop


async def requested_grammar(request, checker: GrammarChecker, max_choices: int | None = None) -> str | None:
    """The grammar of the request's response_format or structured_outputs (not checked yet: see `checked`);
    `max_choices`: the most strings a `choice` may list (--max-structured-output-choices)."""
    fmt = request.response_format
    extras = request.structured_outputs
    if fmt is not None and fmt.type != "text" and extras is not None:
        raise InvalidRequest("Give `response_format` or `structured_outputs`, not both.", param="structured_outputs")
    if extras is not None:
        return await _extras_grammar(extras, checker, max_choices)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return grammars.json_object_grammar()
    spec = fmt.json_schema
    if spec is None:
        raise InvalidRequest("`response_format` of type json_schema needs `json_schema`.", param="response_format")
    schema = spec.schema_ if spec.schema_ is not None else {}
    return await schema_grammar(schema, checker, "response_format.json_schema.schema")


async def _extras_grammar(extras, checker: GrammarChecker, max_choices: int | None) -> str:
    given = [kind for kind in _KINDS if getattr(extras, kind + "_" if kind == "json" else kind) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            f"`structured_outputs` takes exactly one of {', '.join(_KINDS)}" + (f"; got {', '.join(given)}." if given else "."),
            param="structured_outputs",
        )
    kind = given[0]
    value = getattr(extras, kind + "_" if kind == "json" else kind)
    try:
        return await checker.build(kind, value, not extras.disable_any_whitespace, max_choices)
    except grammars.GrammarError as exc:
        raise InvalidRequest(f"Invalid `structured_outputs.{kind}`: {exc}", param=f"structured_outputs.{kind}") from None


async def schema_grammar(schema: dict, checker: GrammarChecker, param: str) -> str:
    """The grammar of a JSON schema (response_format's, or the one that forces tool calls); a 400 naming `param`
    if it has none. Built here, a schema costs the event loop about 4 us per node (closed_objects' walk and json's
    dumps): a 6 MB schema held it 0.9 s. So from INLINE_SCHEMA_BYTES of JSON on, a checker builds it, in its own
    process; a smaller one is built here, where it costs less than the round trip."""
    try:
        text = orjson.dumps(schema)
    except orjson.JSONEncodeError:  # an integer past 64 bits, which json writes: a schema made by hand, small
        text = b""
    try:
        if len(text) < INLINE_SCHEMA_BYTES:
            return grammars.json_schema_grammar(schema)
        return await checker.build("json", text.decode())
    except grammars.GrammarError as exc:
        raise InvalidRequest(f"Invalid `{param}`: {exc}", param=param) from None


async def checked(grammar: str, param: str, checker: GrammarChecker) -> str:
    """`grammar`, once it compiles; else a 400 naming the problem."""
    try:
        await checker.check(grammar)
    except grammars.GrammarError as exc:
        raise InvalidRequest(f"Invalid `{param}`: {exc}", param=param, code="invalid_structured_output") from None
    return grammar
