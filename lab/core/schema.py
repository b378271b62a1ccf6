"""One validator for typed tables: every value a file or flag gives is checked here, with where it came from.

A table is described by :class:`Field` s (a kind, a help line, choices); :func:`read_table` checks each value
against its field and rejects keys nobody declared, naming the valid ones. ``where(key)`` says where a value
came from (``experiments/x.toml:7``) so every message names the file and line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lab.core.errors import UserError

KINDS = ("int+", "int0", "number+", "bool", "str", "strs", "ints+")


@dataclass(frozen=True)
class Field:
    """One key of a table.

    Attributes:
        kind: ``int+`` (positive integer), ``int0`` (non-negative integer), ``number+`` (positive, finite),
            ``bool``, ``str``, ``strs`` (a string or a list of strings), ``ints+`` (a non-empty list of positive
            integers).
        help: what it means, with its unit.
        choices: valid values of a ``str`` field (empty: any).
    """

    kind: str
    help: str = ""
    choices: tuple[str, ...] = ()


def _describe(f: Field) -> str:
    return {
        "int+": "a positive integer",
        "int0": "a non-negative integer",
        "number+": "a positive, finite number",
        "bool": "true or false",
        "str": "a string" if not f.choices else "one of " + ", ".join(f.choices),
        "strs": "a name or a list of names",
        "ints+": "a non-empty list of positive integers",
    }[f.kind]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_value(v: Any, f: Field) -> Any:
    """``v`` if it fits ``f`` (a list of names becomes a tuple); raises ``ValueError`` with what is valid."""
    k = f.kind
    ok = {
        "int+": lambda: _is_int(v) and v >= 1,
        "int0": lambda: _is_int(v) and v >= 0,
        "number+": lambda: (_is_int(v) or isinstance(v, float)) and 0 < v < math.inf,
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str) and (not f.choices or v in f.choices),
        "strs": lambda: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "ints+": lambda: isinstance(v, list) and bool(v) and all(_is_int(x) and x >= 1 for x in v),
    }[k]()
    if not ok:
        raise ValueError(_describe(f))
    return tuple(v) if k == "strs" and isinstance(v, list) else v


def read_table(
    table: Mapping[str, Any], fields: Mapping[str, Field], section: str, where: Callable[[str | None], str]
) -> dict[str, Any]:
    """The table's values, each checked against its field.

    Raises:
        UserError: ``where: [section].key = value must be ...`` or an unknown key with the valid ones.
    """
    if not isinstance(table, Mapping):
        raise UserError(f"{where(None)}: [{section}] must be a table")
    out: dict[str, Any] = {}
    for key, v in table.items():
        f = fields.get(key)
        if f is None:
            raise UserError(f"{where(key)}: [{section}].{key} is not a known field; valid: {', '.join(sorted(fields))}")
        try:
            out[key] = check_value(v, f)
        except ValueError as exc:
            raise UserError(f"{where(key)}: [{section}].{key} = {v!r} must be {exc}") from None
    return out


__all__ = ["KINDS", "Field", "check_value", "read_table"]
