"""How much each class's error leans on the constants nobody measured for it: every B and C constant
(:mod:`lab.predict.constants`) swapped for its stated alternative, one at a time, and both splits priced again.

A constant whose swap moves a class's mean |err| by a lot is one that class's answers depend on; whether the swap
makes the error smaller or larger says nothing about which value is right (on the development set, a smaller error is
in-sample; only the test split's figure could say, and a change made after looking at it moves the runs looked at to
the development set).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lab.core.table import render
from lab.predict import constants as K
from lab.studies.validate_public import PublicValidation, run_public_validation


def _class_means(v: PublicValidation) -> dict[str, float | None]:
    return {g: c["mean_abs_error"] for g, c in v.classes().items()}


def _fmt(x: object) -> str:
    if isinstance(x, float) and (abs(x) < 1e-3 or abs(x) >= 1e4):
        return f"{x:.3g}"
    if isinstance(x, tuple):
        return "curve"
    return f"{x:g}" if isinstance(x, int | float) else str(x)


@dataclass(frozen=True)
class Sensitivity:
    """Per split, each class's mean |err| at the model's constants and with each B/C constant swapped."""

    baseline: dict[str, dict[str, float | None]]  # split -> class -> mean |err|
    swaps: tuple[tuple[K.Constant, dict[str, dict[str, float | None]]], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "constants": [
                {
                    "name": c.name,
                    "grade": c.grade,
                    "value": c.value,
                    "alternative": c.alternative,
                    "why": c.why,
                    "source": c.source,
                    "mean_abs_error": by_split,
                }
                for c, by_split in self.swaps
            ],
        }

    def moved(self, c: K.Constant, by_split: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float]]:
        """The change of each class's mean |err| (percentage points as fractions) where the swap moved it."""
        out: dict[str, dict[str, float]] = {}
        for split, classes in by_split.items():
            for g, m in classes.items():
                base = self.baseline[split].get(g)
                if m is not None and base is not None and abs(m - base) >= 5e-4:
                    out.setdefault(split, {})[g] = m - base
        return out

    def table(self) -> str:
        classes = sorted({g for b in self.baseline.values() for g in b})
        splits = list(self.baseline)
        head = ["constant", "grade", "value", "alternative"] + [f"{s[:3]}. {g}" for s in splits for g in classes]
        rows = [
            ["(as built)", "", "", ""]
            + [
                f"{100 * m:.1f}%" if (m := self.baseline[s].get(g)) is not None else "-"
                for s in splits
                for g in classes
            ]
        ]
        quiet = []
        for c, by_split in self.swaps:
            moved = self.moved(c, by_split)
            if not moved:
                quiet.append(c.name)
                continue
            cells = []
            for s in splits:
                for g in classes:
                    d = moved.get(s, {}).get(g)
                    cells.append(f"{100 * d:+.1f}" if d is not None else "")
            rows.append([c.name, c.grade, _fmt(c.value), _fmt(c.alternative), *cells])
        text = render(
            head,
            rows,
            title="Mean |err| by class as built, and its change in points with each B/C "
            "constant swapped for its alternative (dev. = development set, tes. = test split)",
        )
        if quiet:
            text += f"\n\nmoved no class by 0.05 points or more: {', '.join(quiet)}"
        return text


def run_sensitivity(splits: tuple[str, ...] = ("development", "test")) -> Sensitivity:
    """Price every split as built and with each B/C constant swapped (module docstring); a swap reprices only the
    runs on chips it touches, the others keep their error."""
    from lab.studies.intervals_fit import repriced

    built = {s: run_public_validation(s) for s in splits}
    baseline = {s: _class_means(v) for s, v in built.items()}
    swaps = []
    for c in K.uncertain():
        by_split = {}
        for s, v in built.items():
            moved = repriced(v, c)
            rows = tuple(dataclasses.replace(r, error=moved.get(r.run.case_id, r.error)) for r in v.rows)
            by_split[s] = _class_means(dataclasses.replace(v, rows=rows))
        swaps.append((c, by_split))
    return Sensitivity(baseline, tuple(swaps))


__all__ = ["Sensitivity", "run_sensitivity"]
