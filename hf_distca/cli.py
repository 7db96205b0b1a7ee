"""Command-line options generated from :class:`~hf_distca.config.DistCAConfig`.

The dataclass is the one source of truth: every field becomes ``--field-name`` with the field's
default and its docstring as help, so a recipe never keeps its own copy of names or defaults.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from functools import cache

from hf_distca.config import DistCAConfig

__all__ = ["add_config_arguments", "config_from_args"]

_SCALARS = (bool, int, float, str)


def add_config_arguments(parser: argparse.ArgumentParser, title: str = "DistCA engine") -> None:
    """Add one option per ``DistCAConfig`` field to ``parser`` (in an argument group named ``title``).

    Booleans become ``--name/--no-name``; ``X | None`` fields take an ``X`` (or ``none`` for None when their
    default is not None) and default to the field's default. Values are checked by ``DistCAConfig.__post_init__`` when :func:`config_from_args` builds it.
    """
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(DistCAConfig)
    docs = _field_docs()
    for field in dataclasses.fields(DistCAConfig):
        kind = _scalar_type(field.name, hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        help_text = " ".join(docs.get(field.name, "").split()).replace("%", "%%") + " (default: %(default)s)"
        if kind is bool:
            group.add_argument(
                flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text,
            )
        else:
            convert = kind
            if field.default is not None and type(None) in typing.get_args(hints[field.name]):
                convert = _or_none(kind)
                help_text = help_text.replace(" (default:", " ('none': None) (default:")
            group.add_argument(flag, dest=field.name, type=convert, default=field.default, help=help_text)


def config_from_args(args: argparse.Namespace) -> DistCAConfig:
    """The ``DistCAConfig`` of options added by :func:`add_config_arguments`."""
    return DistCAConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistCAConfig)})


def _or_none(kind: type):
    """``kind`` of a command-line string, with ``none`` (any case) read as None."""

    def convert(text: str):
        return None if text.lower() == "none" else kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in its errors
    return convert


def _scalar_type(name: str, hint) -> type:
    """bool/int/float/str, also out of ``X | None``; anything else has no command-line form."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            hint = options[0]
    if hint in _SCALARS:
        return hint
    raise TypeError(
        f"DistCAConfig.{name} has type {hint!r}, which has no command-line form; use bool, int, float, str "
        "(or one of them | None), or extend hf_distca.cli"
    )


@cache
def _field_docs() -> dict[str, str]:
    """The docstring written under each field of DistCAConfig (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(DistCAConfig)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value
    return docs
