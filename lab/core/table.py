"""Plain-text tables and JSON output for the command line."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Left-aligned text, right-aligned numbers; one header rule."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True))

    out = [title] if title else []
    out += [line(cells[0]).rstrip(), "  ".join("-" * w for w in widths)]
    out += [line(r).rstrip() for r in cells[1:]]
    return "\n".join(out)


def _is_number(s: str) -> bool:
    if s == "-":  # a placeholder in a numeric column stays right-aligned
        return True
    head = s.split(" ")[0]
    try:
        float(head)
    except ValueError:
        return False
    return True


def non_finite(
    obj: Any, allowed: Callable[[str, Mapping[str, Any]], bool] | None = None, path: str = ""
) -> tuple[str, float] | None:
    """The first ``inf`` or ``nan`` in a result, as ``(path, value)`` (``rows[3].decode_step_s``), or None.

    A result that is not finite has overflowed (or divided by an input of zero): the command line refuses it
    instead of printing ``inf`` or a JSON null. ``allowed(key, table)`` names the values whose infinity means
    something (a roofline's ``critical_batch`` of ``inf``: never compute-bound); those are skipped.
    """
    if isinstance(obj, float) and not math.isfinite(obj):
        return path or "result", obj
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v) and allowed is not None and allowed(str(k), obj):
                continue
            found = non_finite(v, allowed, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            found = non_finite(v, allowed, f"{path}[{i}]")
            if found:
                return found
    return None


def _finite(obj: Any) -> Any:
    """JSON has no Infinity or NaN: they become null (the command line has refused any but the documented
    infinities, see :func:`non_finite`, before it prints)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: dict[str, Any]) -> str:
    """One JSON object, strict (no Infinity/NaN), keys in insertion order."""
    import json  # only for --json: a command that prints a table starts without it

    return json.dumps(_finite(obj), indent=2, allow_nan=False)
