"""Request body bytes to a protocol model in one pydantic pass, or an InvalidRequest that says what is wrong
in words a client can act on (the field's name in `param`)."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from pydantic import BaseModel, ValidationError

from apiserver.errors import ApiError, InvalidRequest
from apiserver.protocol import UNSUPPORTED_FIELDS, Undone


UTF8_BOM = b"\xef\xbb\xbf"


async def request_body(request) -> bytes:
    """The request's body, as sent. A 415 when it comes compressed (Content-Encoding gzip, br, ...): this server
    reads bodies as they are, and a gzipped JSON body was a 400 "not valid JSON at column 1" that sent the client
    looking at its JSON. Read first, so the connection stays usable after the answer. A UTF-8 byte order mark
    before the JSON is dropped, as Python's json reads bytes (and so vLLM): Windows tools write one."""
    body = await request.body()
    if body[:3] == UTF8_BOM:
        body = body[3:]
    # Every coding of every Content-Encoding line (a list may be split over several lines, RFC 9110 5.3).
    codings = [c.strip().lower() for line in request.headers.getlist("content-encoding") for c in line.split(",")]
    if any(c not in ("", "identity") for c in codings):
        encoding = ", ".join(request.headers.getlist("content-encoding"))
        raise ApiError(f"The request body comes with Content-Encoding `{encoding[:40]}`; this server reads only "
                       f"uncompressed bodies: send it without compression.", code="unsupported_content_encoding",
                       status=415, headers={"Accept-Encoding": "identity"})  # RFC 7694's answer
    return body


def parse_body(model: type[BaseModel], body: bytes):
    if not body:
        raise InvalidRequest("The request body is empty: expected a JSON object.")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid_request(exc, model) from None


# Bodies from this size on are parsed one at a time, each in a pass of the event loop of its own: an 8 MB body
# takes 0.3-1 s to parse (250,000 tiny messages: 1 s), pydantic keeps the GIL meanwhile (a thread would not free
# the loop), and eight that arrived together were parsed in one pass, 10.7 s without a heartbeat: the supervisor
# killed the API server with every stream on it. One at a time, timers (the heartbeat) and other clients' work
# run between two of them.
LARGE_BODY_BYTES = 1 << 20
_large_bodies: asyncio.Lock | None = None


@asynccontextmanager
async def parsing(body: bytes):
    """Around the parsing of a request's `body` (a large one waits for the one before it, and the next one for
    the next pass of the loop)."""
    global _large_bodies
    if len(body) < LARGE_BODY_BYTES:
        yield
        return
    if _large_bodies is None:
        _large_bodies = asyncio.Lock()
    async with _large_bodies:
        try:
            yield
        finally:
            await asyncio.sleep(0)  # held over a pass: the next waiter parses in the pass after


async def parse_request_body(model: type[BaseModel], body: bytes):
    """`parse_body`, one large body at a time (`parsing`); a small one at once, without the context manager's
    generator (every chat and completion comes here)."""
    if len(body) < LARGE_BODY_BYTES:
        return parse_body(model, body)
    async with parsing(body):
        return parse_body(model, body)


def _invalid_request(exc: ValidationError, model: type[BaseModel]) -> InvalidRequest:
    error = max(exc.errors(include_url=False, include_input=False), key=_specificity)
    kind = error["type"]
    if kind == "json_invalid":
        reason = error["ctx"]["error"]
        if "hex escape" in reason:  # jiter's words for a \uD800-\uDFFF escape without its other half
            reason += " (an escape from \\uD800 to \\uDFFF is half of a UTF-16 surrogate pair and needs its other half)"
        if "recursion limit" in reason:  # valid JSON, past jiter's depth (about 200 arrays and objects)
            return InvalidRequest(f"The request body nests arrays and objects deeper than this server reads (about "
                                  f"200 levels): {reason}.")
        return InvalidRequest(f"The request body is not valid JSON: {reason}")
    if kind == "model_type" and not error["loc"]:
        return InvalidRequest("The request body must be a JSON object.")
    loc = error["loc"]
    path = ".".join(str(part) for part in _field_path(loc))
    field = str(loc[0]) if loc else None
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unsupported field: `{path}` is not a parameter this server accepts.", param=path)
    if kind == "missing":
        return InvalidRequest(f"Missing required field: `{path}`.", param=path)
    if field in UNSUPPORTED_FIELDS and path == field:
        return InvalidRequest(f"Unsupported field: `{field}` is not supported by this server.", param=field)
    undone = _undone(model, field) if path == field else None
    if undone is not None:
        return InvalidRequest(f"Unsupported value for `{field}`: {undone.reason}.", param=field)
    return InvalidRequest(f"Invalid value for `{path}`: {error['msg']}.", param=path)


def _undone(model: type[BaseModel], field: str | None) -> Undone | None:
    """The Undone mark of `model`'s field `field` (a vLLM field it takes only at rest), if it has one."""
    info = model.model_fields.get(field) if field else None
    return next((mark for mark in info.metadata if isinstance(mark, Undone)), None) if info is not None else None


def _specificity(error: dict) -> tuple[int, bool]:
    """With a union, every branch reports; the most telling error went deepest into the value, and is about
    a value rather than a type ("must be >= 0" over "should be a string")."""
    return len(_field_path(error["loc"])), not error["type"].endswith("_type")


def _field_path(loc: tuple) -> list:
    """An error's location as the request's fields: union branches add their type name to it, and a union by a
    tag nested in another union (`tool_choice`'s kinds) its name and then the tag's value, which the client only
    sent as `type`."""
    path, after_tag = [], False
    for part in loc:
        if after_tag:
            after_tag = False
        elif isinstance(part, str) and part.startswith("tagged-union["):
            after_tag = True
        elif not _is_union_tag(part):
            path.append(part)
    return path


def _is_union_tag(part) -> bool:
    # pydantic names union branches like 'str', 'list[TextPart]', 'function-after[...]', 'constrained-str', or a
    # model's class name ('NamedToolChoice'); field names are snake_case.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "constrained-str")
                                      or part[:1].isupper())
