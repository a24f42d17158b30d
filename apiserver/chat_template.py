"""Chat templates rendered with jinja2 directly, exactly as transformers' `apply_chat_template` renders them.

The API server must not import transformers (it pulls in torch where torch is installed: 585 MB of RSS on a
CUDA machine), so this is transformers' own recipe (`utils/chat_template_utils.py`, 5.x) restated: an
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension and a no-op
`{% generation %}` tag, `tojson` without HTML escaping, `raise_exception`, `strftime_now`, and the sandboxed
`dict` and `namespace`; the model's special tokens are variables (`bos_token`, ...), the request's
chat_template_kwargs override them; `continue_final_message` cuts the text after the final message.
A test renders the same conversations here and through transformers and compares.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A message's reasoning may come under any of these names; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it, or the request asks what it cannot do)."""


def render_chat(
    template: str,
    messages: list[dict],
    variables: dict,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
) -> str:
    """The text of `messages` (which may call `tools`) under `template`; `variables` are the special tokens and the
    request's kwargs.
    Raises ChatTemplateError, or jinja2.TemplateError from the template itself (`raise_exception`)."""
    if not messages:
        raise ChatTemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible.")
    # Fresh copies without None values (templates render a None as "None"), so the edits below stay here.
    chat = _alias_reasoning_fields([{k: v for k, v in m.items() if v is not None} for m in messages])
    final_message = None
    if continue_final_message:
        final_message = _tag_final_message(template, chat)
    text = _compile(template).render(
        messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )
    if final_message is not None:
        text = _cut_after_final_message(text, final_message)
    return text


def _tag_final_message(template: str, chat: list[dict]) -> str:
    """Mark the end of the final message's content, so the text can be cut there after rendering."""
    final_message = chat[-1].get("content")
    if final_message is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ChatTemplateError('continue_final_message is set to "content" but this is not an accepted field in '
                                "the chat_template")
    if isinstance(final_message, (list, tuple)):
        for block in reversed(final_message):
            if "text" in block:
                final_message = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ChatTemplateError("continue_final_message is set but we could not find any text to continue in "
                                    "the final message!")
    else:
        chat[-1]["content"] = final_message + _CONTINUE_TAG
    return final_message


def _cut_after_final_message(text: str, final_message: str) -> str:
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the chat "
                                "after applying the chat template")
    tag_at = text.rindex(_CONTINUE_TAG.strip())
    if text[tag_at:tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:tag_at]  # the template kept the spacing after the message
    return text[:tag_at].rstrip()  # it trimmed trailing spaces: so does the continuation point


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body.
    Without it a template that uses the tag would not even parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the attributes of the real type a template could reach through."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (a way towards CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from its context, beyond what it sets itself: which request variables (a
    reasoning effort, ...) it can take at all."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    compiled = _environment().from_string(template)
    # jinja keeps a template's globals as a ChainMap over the environment's and copies them into a new dict on
    # every render, through the ChainMap's slow iteration: half of a short chat's render. Nothing changes either
    # after this, so one flat dict serves.
    compiled.globals = dict(compiled.globals)
    return compiled
