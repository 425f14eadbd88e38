"""Command-line options declared once, on the configuration dataclasses' fields.

A field's default, its ``metadata["help"]``, its annotation (``Literal`` → a choice,
``Optional[int]`` → an int defaulting to None, ``Tuple[int, ...]`` → comma-separated values)
and its ``metadata["min"]`` (→ a click range, so a bad value is refused naming the option)
make the option; the dataclass stays the one place that says what a setting means.

Example:
    >>> from eogp_index.config import CurvatureConfig
    >>> @click.command()
    ... @option_group(field_option(CurvatureConfig, "num_examples", "--curvature-examples"), into="curvature")
    ... def fit(curvature):
    ...     print(CurvatureConfig(**curvature))
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Dict, Literal, Optional, Tuple, Union

import click

__all__ = ["CommaSeparated", "field_option", "option_group"]


class CommaSeparated(click.ParamType):
    """``"64,128"`` → ``(64, 128)``, each item converted (and range-checked) by ``item_type``."""

    name = "list"

    def __init__(self, item_type: click.ParamType):
        self.item_type = item_type

    def convert(self, value: Any, param, ctx) -> Tuple[Any, ...]:
        items = value if isinstance(value, (tuple, list)) else [v for v in str(value).replace(" ", "").split(",") if v]
        if not items:
            self.fail("give at least one value, comma-separated", param, ctx)
        return tuple(self.item_type.convert(item, param, ctx) for item in items)

    def get_metavar(self, param, ctx=None) -> str:
        return f"{self.item_type.name.upper()},..."


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves `from __future__ import annotations` strings


def _unwrap_optional(hint: Any) -> Tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _scalar_type(hint: Any, metadata) -> click.ParamType:
    if typing.get_origin(hint) is Literal:
        return click.Choice([str(a) for a in typing.get_args(hint)])
    low = metadata.get("min")
    if hint is int:
        return click.INT if low is None else click.IntRange(min=low, min_open=metadata.get("min_open", False))
    if hint is float:
        return click.FLOAT if low is None else click.FloatRange(min=low, min_open=metadata.get("min_open", False))
    if hint is str:
        return click.STRING
    raise TypeError(f"no command-line type for {hint!r}")


def field_option(cls: type, name: str, *decls: str, **attrs: Any) -> Callable:
    """A ``click.option`` for the dataclass field ``cls.name``.

    ``decls`` are the option's names (default ``--field-name``); the command receives the value
    as the field's name. ``attrs`` go to ``click.option`` and win over what the field says
    (``multiple=True`` makes a tuple field repeatable instead of comma-separated).
    """
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if field is None:
        raise TypeError(f"{cls.__name__} has no field {name!r}")
    hint, optional = _unwrap_optional(_hints(cls)[name])
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = None
        attrs.setdefault("required", True)
    decls = decls or ("--" + name.replace("_", "-"),)
    kwargs: Dict[str, Any] = {
        "default": default,
        "help": field.metadata.get("help"),
        "show_default": default is not None and default != (),
    }
    if hint is bool:
        kwargs["is_flag"] = True
        if default:  # a flag that is on by default needs a way to turn it off
            decls = tuple(f"{d}/--no-{d[2:]}" if d.startswith("--") else d for d in decls)
    elif typing.get_origin(hint) is tuple:
        item = _scalar_type(typing.get_args(hint)[0], field.metadata)
        if attrs.get("multiple"):
            kwargs["type"] = item
            if optional:  # nothing given means None, not an empty tuple
                kwargs["callback"] = lambda _ctx, _param, value: value or None
        else:
            kwargs["type"] = CommaSeparated(item)
            if default is not None:  # given as typed, so that --help shows it so
                kwargs["default"] = ",".join(map(str, default))
    else:
        kwargs["type"] = _scalar_type(hint, field.metadata)
    if "show_default" in field.metadata:  # a default that depends on the machine, shown as it is meant
        kwargs["show_default"] = field.metadata["show_default"]
    kwargs.update(attrs)
    return click.option(*decls, name, **kwargs)


def option_group(*options: Callable, into: Optional[str] = None) -> Callable:
    """Apply ``options`` (listed in --help in this order); with ``into``, hand their values to the
    command as one dict of that name (``{field: value}``, ready for ``SomeConfig(**into)``)."""

    def decorate(func: Callable) -> Callable:
        before = len(getattr(func, "__click_params__", []))
        for option in reversed(options):
            func = option(func)
        if into is None:
            return func
        names = [p.name for p in func.__click_params__[before:]]

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            kwargs[into] = {name: kwargs.pop(name) for name in names}
            return func(*args, **kwargs)

        return wrapper

    return decorate
