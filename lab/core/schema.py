"""One validator for typed tables: every value a file or flag gives is checked here, with where it came from.

A table is described by :class:`Field` s (a kind, a help line, choices); :func:`read_table` checks each value
against its field and rejects keys nobody declared, naming the valid ones. ``where(key)`` says where a value
came from (``experiments/x.toml:7``) so every message names the file and line.

The command line's numbers go through the ``parse_*`` functions below (positive and non-negative integers with
``8k``/``2Mi``/``1e6`` spellings, positive finite numbers, fractions in (0, 1], comma-separated lists): every flag
uses them, through the argparse adapters in :mod:`lab.cli.args`, so one mistake reads the same on every command.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lab.core.errors import UserError

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

INT_LIMIT = 2**63  # integers at or above this are refused: beyond any real size, and beyond int64 downstream
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
        "int+": "a positive integer (below 2**63)",
        "int0": "a non-negative integer (below 2**63)",
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
        "int+": lambda: _is_int(v) and 1 <= v < INT_LIMIT,
        "int0": lambda: _is_int(v) and 0 <= v < INT_LIMIT,
        "number+": lambda: (_is_int(v) or isinstance(v, float)) and 0 < v < math.inf,
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str) and (not f.choices or v in f.choices),
        "strs": lambda: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "ints+": lambda: isinstance(v, list) and bool(v) and all(_is_int(x) and 1 <= x < INT_LIMIT for x in v),
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


# ----- numbers from the command line --------------------------------------------------------------
# One parser per kind of number a flag takes; each names the flag, the value and what is valid, so that every
# command refuses 0, -3, 1.5, nan, inf and 1e999 with the same words. ``what`` is the flag (``--chips``); empty
# when argparse names the flag itself.

_SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
_INT_TEXT = re.compile(r"([+-]?[0-9.]+(?:e[+-]?[0-9]+)?)\s*(ki|mi|gi|k|m|g)?")


def _named(what: str, text: str) -> str:
    return f"{what}: {text}" if what else text


def parse_int(val: str | int, what: str = "", *, minimum: int = 1) -> int:
    """An integer >= ``minimum`` from ``"8192"``, ``"8k"``, ``"2Mi"`` or ``"1e6"`` (suffixes: k, M, G; Ki, Mi, Gi).

    Raises:
        UserError: not a number, not an integer, below ``minimum``, or too large (``1e999``, ``inf``, ``nan``).
    """
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    example = "4096 or 8Ki" if minimum >= 1 else "0, 1 or 4096"  # 8k is 8000: SI, as 8Ki is 8192
    s = str(val).strip().lower()
    m = _INT_TEXT.fullmatch(s)
    if s.lstrip("+-") in ("inf", "infinity", "nan"):
        raise UserError(_named(what, f"{val!r} is not a finite number; use {kind} like {example}"))
    if not m:
        raise UserError(_named(what, f"{val!r} is not a number; use {kind} like {example}"))
    num, scale = m.group(1), _SUFFIX.get(m.group(2) or "", 1)
    if len(num.lstrip("+-").lstrip("0")) > 19:  # more digits than any int64 (and than int() reads unasked)
        raise UserError(_named(what, f"{val!r} is too large; use {kind} like {example}"))
    try:  # digits alone are read exactly; 1e6 and 1.5k through a float
        x: int | float = int(num) * scale if num.lstrip("+-").isdigit() else float(num) * scale
    except ValueError:
        raise UserError(_named(what, f"{val!r} is not a number; use {kind} like {example}")) from None
    if not math.isfinite(x) or abs(x) >= INT_LIMIT:
        raise UserError(_named(what, f"{val!r} is too large; use {kind} like {example}"))
    if x != int(x):
        raise UserError(_named(what, f"{val!r} must be {kind}, e.g. {example}"))
    if x < minimum:
        if x < 0 and minimum >= 0:
            raise UserError(_named(what, f"{val!r} is not a number >= {minimum}; use {kind} like {example}"))
        raise UserError(_named(what, f"{val!r} must be {kind}, e.g. {example}"))
    return int(x)


def parse_positive_int(val: str | int, what: str = "") -> int:
    """An integer > 0 (see :func:`parse_int`)."""
    return parse_int(val, what, minimum=1)


def parse_nonneg_int(val: str | int, what: str = "") -> int:
    """An integer >= 0 (see :func:`parse_int`)."""
    return parse_int(val, what, minimum=0)


def _float(val: str | float, what: str, kind: str, example: str) -> float:
    s = str(val).strip()
    try:
        x = float(s)
    except ValueError:
        raise UserError(_named(what, f"{val!r} is not a number; use {kind} like {example}")) from None
    if math.isnan(x):
        raise UserError(_named(what, f"{val!r} is not a number; use {kind} like {example}"))
    if math.isinf(x):
        raise UserError(_named(what, f"{val!r} is not finite (too large); use {kind} like {example}"))
    return x


def parse_positive_float(val: str | float, what: str = "", example: str = "2.5 or 1e12") -> float:
    """A finite number > 0 (``1e12``, ``0.5``); refuses 0, negatives, ``nan``, ``inf`` and ``1e999``."""
    kind = "a positive, finite number"
    x = _float(val, what, kind, example)
    if not x > 0:
        raise UserError(_named(what, f"{val!r} must be {kind}, e.g. {example}"))
    return x


def parse_nonneg_float(val: str | float, what: str = "", example: str = "0 or 1e12") -> float:
    """A finite number >= 0; refuses negatives, ``nan``, ``inf`` and ``1e999``."""
    kind = "a finite number >= 0"
    x = _float(val, what, kind, example)
    if x < 0:
        raise UserError(_named(what, f"{val!r} must be {kind}, e.g. {example}"))
    return x + 0.0  # -0.0 reads as 0


def parse_fraction(val: str | float, what: str = "") -> float:
    """A fraction in (0, 1], such as an MFU of ``0.4``; refuses 0, 40 (a percentage), ``nan`` and ``inf``."""
    kind = "a fraction in (0, 1]"
    x = _float(val, what, kind, "0.4")
    if not 0 < x <= 1:
        hint = f" (for {x:g}% write {x / 100:g})" if 1 < x <= 100 else ""
        raise UserError(_named(what, f"{val!r} must be {kind}, e.g. 0.4{hint}"))
    return x


def parse_positive_ints(val: str, what: str = "") -> tuple[int, ...]:
    """``"1,2,8k"`` -> ``(1, 2, 8000)``: a non-empty, comma-separated list of positive integers, in the order given.

    Raises:
        UserError: an empty list, an empty item (``8,,16`` or a trailing comma) or an item that is not a
            positive integer.
    """
    s = str(val).strip()
    if not s:
        raise UserError(_named(what, "the list is empty; give positive integers separated by commas, e.g. 1,2,4,8"))
    items = [x.strip() for x in s.split(",")]
    if any(not x for x in items):
        raise UserError(
            _named(what, f"{val!r} has an empty item; give positive integers separated by commas, e.g. 1,2,4,8")
        )
    return tuple(parse_positive_int(x, f"{what} item" if what else "item") for x in items)


__all__ = [
    "INT_LIMIT",
    "KINDS",
    "Field",
    "check_value",
    "parse_fraction",
    "parse_int",
    "parse_nonneg_float",
    "parse_nonneg_int",
    "parse_positive_float",
    "parse_positive_int",
    "parse_positive_ints",
    "read_table",
]
