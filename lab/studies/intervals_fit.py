"""The residual table behind every estimate's interval (:mod:`lab.predict.intervals`), derived from the development
set, and the intervals of the published runs themselves: how often the measured value falls inside.

``python -m lab.studies.intervals_fit`` (or ``shardlab validate --write-intervals``) writes the table; the test split is
never read to make it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Any

from lab.core.errors import UserError
from lab.predict import constants as K
from lab.predict import intervals as iv
from lab.studies.validate_public import (
    LOADED_CLASS,
    PublicValidation,
    interval_class,
    loaded,
    predict,
    run_public_validation,
    steady_price,
)


def _time_ratio(error: float) -> float:
    """A row's error as predicted time over measured time (errors read as a time: validate_public)."""
    return 1.0 + error


def touched(c: K.Constant, run) -> bool:
    """Whether the constant ``c`` can move the run's prediction (it touches the run's chip family or kind)."""
    from lab.core.hardware import get_chip
    from lab.predict.efficiency import family

    try:
        chip = get_chip(run.chip)
    except UserError:
        return False
    return c.touches(family(chip), chip.kind) and run.kind in c.prices


def repriced(v: PublicValidation, c: K.Constant, steady: dict[str, float] | None = None) -> dict[str, float]:
    """With the constant ``c`` swapped for its alternative: each answered run it touches, its error (as a time). A
    run served under load moves by its steady step's ratio (validate_public.steady_price; ``steady``: the built
    prices, by case), not by a new simulation of its load."""
    rows = [r for r in v.predicted if touched(c, r.run)]
    steady = steady if steady is not None else {}
    for r in rows:  # the built steady prices, before the swap
        if loaded(r.run) and r.run.case_id not in steady:
            steady[r.run.case_id] = steady_price(r.run)
    out = {}
    with K.swapped(c.name):
        for r in rows:
            run = r.run
            if loaded(run):
                out[run.case_id] = (1.0 + r.error) * steady_price(run) / steady[run.case_id] - 1.0
                continue
            row = predict(run)
            if row.error is not None:
                out[run.case_id] = row.error
    return out


def run_shifts(split: str, base: PublicValidation | None = None) -> dict[str, dict[str, float]]:
    """Per answered run of ``split``: each B/C constant's swapped prediction over the built one, as times."""
    base = base or run_public_validation(split)
    built = {r.run.case_id: r.error for r in base.rows if r.error is not None}
    out: dict[str, dict[str, float]] = {case: {} for case in built}
    steady: dict[str, float] = {}
    for c in K.uncertain():
        for case, error in repriced(base, c, steady).items():
            ratio = _time_ratio(error) / _time_ratio(built[case])
            if abs(ratio - 1) > 1e-9:
                out[case][c.name] = ratio
    return out


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def fit(dev: PublicValidation) -> dict[str, Any]:
    """The class spreads of the development set's residuals (lab.predict.intervals' docstring)."""
    by_class: dict[str, dict[str, list[float]]] = {}
    for r in dev.predicted:
        res = -math.log(_time_ratio(r.error))  # log(measured / predicted)
        by_class.setdefault(interval_class(r.run), {}).setdefault(r.run.source_name, []).append(res)
    source_means = {g: {s: statistics.mean(v) for s, v in srcs.items()} for g, srcs in by_class.items()}
    # a class of too few sources pools the between-source spread of its population: one-step prices, or loads
    pools: dict[bool, list[float]] = {True: [], False: []}
    for g, means in source_means.items():
        pools[LOADED_CLASS in g].extend(means.values())
    pooled = {under_load: _sd(means) for under_load, means in pools.items()}
    classes = []
    for g, srcs in by_class.items():
        means = source_means[g]
        all_means = pools[LOADED_CLASS in g]
        pooled_between = pooled[LOADED_CLASS in g]
        n = sum(len(v) for v in srcs.values())
        within = [x - means[s] for s, v in srcs.items() for x in v]
        dof = n - len(srcs)
        s_within = math.sqrt(sum(d * d for d in within) / dof) if dof > 0 else 0.0
        few = len(srcs) < iv.MIN_SOURCES
        classes.append(
            iv.ClassSpread(
                name=g,
                runs=n,
                sources=len(srcs),
                mu=0.0 if few else statistics.mean(means.values()),
                s_between=pooled_between if few else _sd(list(means.values())),
                s_within=s_within,
                dof=(len(all_means) if few else len(srcs)) - 1,
                k=len(all_means) if few else len(srcs),
            ).to_dict()
        )
    return {
        "derived_from": "the development set's answered runs (lab/studies: public_runs.py, public_serving.py, "
        "data/development/)",
        "pooled_s_between": pooled[False],
        "pooled_s_between_under_load": pooled[True],
        "classes": sorted(classes, key=lambda c: c["name"]),
    }


def write(path=iv.TABLE) -> dict[str, Any]:
    data = fit(run_public_validation("development"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    iv._LOADED = None  # the next estimate reads the new table
    return data


def with_intervals(v: PublicValidation) -> PublicValidation:
    """``v`` with each answered run's 80% interval, as a ratio to its prediction (its class's spread and its swaps)."""
    shifts = run_shifts(v.split, v)
    out = {}
    for r in v.predicted:
        out[r.run.case_id] = iv.interval(1.0, interval_class(r.run), shifts.get(r.run.case_id))
    return dataclasses.replace(v, intervals=out)


if __name__ == "__main__":
    print(json.dumps(write(), indent=1))


__all__ = ["fit", "repriced", "run_shifts", "touched", "with_intervals", "write"]
