"""--config FILE: the command line's options from a YAML file (vLLM's `--config`), for a service that keeps its
settings in /etc rather than in a long ExecStart line.

    model: /srv/models/llama-3.1-8b
    api-server-count: 8
    enable-prefix-caching: false
    allowed-origins: [https://app.example.com]

A key is an option's name without its dashes (`api-server-count`, or `api_server_count`); a switch takes true or
false; an option given more than once (`--middleware`) takes a list. The command line wins, then an environment
variable (`SUPERVISE_API_KEY`), then the file, then the default (click's order). Every value must be of its
option's kind and then goes through the option's own check, so a bad one is the same one line and exit 2 as on
the command line; a key that is no option is refused by name rather than ignored (a typo would silently keep a
default).
"""
from __future__ import annotations

import json
import os
import stat

import click
import yaml  # type: ignore[import-untyped]

MAX_BYTES = 1 << 20  # an operator's settings; anything larger is not one


def load_config_file(ctx: click.Context, param: click.Parameter, paths: tuple[str, ...]) -> None:
    """An eager option's callback: the file's settings become the defaults of the options parsed after it. One
    file: given twice, the first one's settings were dropped without a word."""
    if not paths:
        return
    if len(paths) > 1:
        raise click.BadParameter(f"one settings file, not {len(paths)} ({', '.join(paths)})", param=param)
    (path,) = paths
    settings = _read(path)
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option) and p.name}
    defaults: dict[str, object] = {}
    for key, value in settings.items():
        name = str(key).replace("-", "_")
        option = options.get(name)
        if option is None or option is param:
            raise click.BadParameter(f"{path}: {key!r} is not an option of supervise", param=param)
        if name in defaults:
            raise click.BadParameter(f"{path}: {key!r} is given twice (with dashes and with underscores)", param=param)
        defaults[name] = _as_option_takes(option, key, value, path, param)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def _read(path: str) -> dict:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would hang the start, /dev/zero fill it
            raise click.BadParameter(f"{path}: not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise click.BadParameter(f"{path}: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise click.BadParameter(f"{path}: over {MAX_BYTES >> 10} KiB, not a settings file")
    try:
        settings = yaml.load(raw, Loader=_SafeLoaderOfUniqueKeys)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f", line {where.line + 1}" if where is not None else ""
        # (A constructor's error is YAML that reads, with a key twice or a tag that builds an object.)
        what = "" if isinstance(exc, yaml.constructor.ConstructorError) else ": not YAML"
        raise click.BadParameter(f"{path}{at}{what}: {getattr(exc, 'problem', None) or exc}") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise click.BadParameter(f"{path}: expected option: value pairs, found a {type(settings).__name__}")
    return settings


class _SafeLoaderOfUniqueKeys(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice (which it would take the last of without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: list = []
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.append(key)
        return super().construct_mapping(node, deep)


def _as_option_takes(option: click.Option, key, value, path: str, param: click.Parameter):
    """The value as the command line would hand it over: a list for a repeatable option, JSON for a list or a
    mapping given to an option that takes text (vLLM's list options take JSON), the rest as they are, once each
    value is of a kind the option takes."""
    if option.multiple:
        values = value if isinstance(value, list) else [value]
        for item in values:
            _check_kind(option, key, item, path, param)
        return values
    if isinstance(value, (list, dict)) and isinstance(option.type, click.types.StringParamType):
        return json.dumps(value)
    _check_kind(option, key, value, path, param)
    return value


def _check_kind(option: click.Option, key, value, path: str, param: click.Parameter) -> None:
    """A value of the kind the option takes (text is always one: the option then reads it as from the command
    line). The option's own conversion would take others without a word, or fail with a traceback: YAML reads
    `api-key: 0123` as the number 83, `yes` as true, and click makes 1.5 servers one and chokes on a switch of 1."""
    kind = option.type
    if isinstance(value, str):
        return
    if isinstance(kind, click.types.BoolParamType):
        ok, wanted = isinstance(value, bool), "true or false"
    elif isinstance(kind, click.types.IntParamType):
        ok, wanted = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif isinstance(kind, click.types.FloatParamType):
        ok, wanted = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        ok, wanted = False, "text: put it in quotes"
    if not ok:
        shown = "nothing" if value is None else f"{value!r} ({type(value).__name__})"
        raise click.BadParameter(f"{path}: {key!r} takes {wanted}, and YAML reads {shown} here", param=param)
