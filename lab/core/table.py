"""Plain-text tables and JSON output for the command line."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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


def _finite(obj: Any) -> Any:
    """JSON has no Infinity or NaN: they become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: dict[str, Any]) -> str:
    """One JSON object, strict (no Infinity/NaN), keys in insertion order."""
    return json.dumps(_finite(obj), indent=2, allow_nan=False)
