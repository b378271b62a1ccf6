"""``shardlab validate``: the estimators replayed on published measured runs (the calibration group, the development
set and the test split), with each run's 80% interval, the sensitivity to graded constants, and one run at a time."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    command,
)
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.table import render

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def cmd_validate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.hardware_file:  # read (and checked) by command(); the published runs are priced on the catalog's chips
        raise UserError(
            f"validate prices the published runs on the catalog's chips (a100-80gb, h100, ...) and reads no "
            f"--hardware-file; drop --hardware-file {args.hardware_file}"
        )
    from lab.studies.intervals_fit import with_intervals
    from lab.studies.validate import run_validation
    from lab.studies.validate_public import run_public_validation

    if args.write_intervals:
        from lab.predict.intervals import TABLE
        from lab.studies.intervals_fit import write

        data = write()
        rows = [
            [c["name"], c["runs"], c["sources"], f"{c['mu']:+.3f}", f"{c['s_between']:.3f}", f"{c['s_within']:.3f}"]
            for c in data["classes"]
        ]
        return data, render(
            ["class", "runs", "sources", "mu", "s between", "s within"],
            rows,
            title=f"wrote {TABLE}: the development set's residuals, log(measured / predicted)",
        )
    if args.case is not None:
        return _validate_case(args.case)
    group = "development" if args.group == "public" else args.group  # 'public': the development set's old name
    data: dict[str, Any] = {}
    texts = []
    if group in ("calibration", "all"):
        v = run_validation()
        data["calibration"] = v.to_dict()
        texts.append(v.table())
    heads = []
    for split in ("development", "test"):
        if group in (split, "all"):
            pv = with_intervals(run_public_validation(split))
            data[split] = pv.to_dict()
            texts.append(pv.table())
            heads.append(pv.headline())
    if group == "all":
        texts.append("\n".join(heads))
    if args.sensitivity:
        from lab.studies.sensitivity import run_sensitivity

        splits = tuple(s for s in ("development", "test") if group in (s, "all"))
        if not splits:
            raise UserError(
                "--sensitivity prices the development set and the test split; give --group development, test or all"
            )
        sens = run_sensitivity(splits)
        texts.append(sens.table())
        if group != "all":
            data = {group: data[group]}
        data["sensitivity"] = sens.to_dict()
        return data, "\n\n".join(texts)
    return (data if group == "all" else next(iter(data.values()))), "\n\n".join(texts)


def _validate_case(case: str) -> tuple[dict[str, Any], str]:
    """One published run: its prediction, error and 80% interval, and the constants that move it most."""
    from lab.predict.intervals import interval
    from lab.studies.intervals_fit import run_shifts
    from lab.studies.validate_public import PublicValidation, interval_class, predict, split_runs

    runs = {r.case_id: r for s in ("development", "test") for r in split_runs(s)}
    run = runs.get(case.strip().upper())
    if run is None:
        raise UserError(
            f"--case {case!r} is no published run; valid: {', '.join(list(runs)[:6])}, ... (validate lists them all)"
        )
    row = predict(run)
    if row.error is None:
        why = row.detail.removeprefix("not expressible: ").removeprefix("refused: ")
        raise UserError(
            f"--case {run.case_id} is not expressible ({why}): it has no prediction, so no interval; "
            "pick an answered run"
        )
    alone = PublicValidation((row,), run.split)
    iv = interval(1.0, interval_class(run), run_shifts(run.split, alone).get(run.case_id))
    inside = iv.lo <= 1 / (1 + row.error) <= iv.hi
    lean = ", ".join(f"{n} x{f:.3f}" for n, f in iv.leaning_on) or "none"
    rows = [
        ["run", f"{run.case_id} ({run.split}): {run.group}, {run.label} on {run.chips} {run.chip}"],
        ["source", run.source],
        ["measured", f"{run.measured:.4g} {run.unit}" + (f"  ({run.quote})" if run.quote else "")],
        ["predicted", f"{row.predicted:.4g} {run.unit}: {row.detail}"],
        ["error (as a time)", f"{100 * row.error:+.1f}%"],
        [
            "80% interval (time)",
            f"{100 * (iv.lo - 1):+.0f}% to {100 * (iv.hi - 1):+.0f}% of the prediction: measured "
            + ("inside" if inside else "OUTSIDE"),
        ],
        ["leans on", lean],
    ]
    data = row.to_dict() | {"interval_ratio": iv.as_list(), "inside": inside, "interval": iv.to_dict()}
    return data, render(["quantity", "value"], rows)


def _register_validate(sub, common, hw, with_chip) -> None:
    v = sub.add_parser("validate", parents=[common], help=help_of("validate"))
    v.add_argument(
        "--group",
        choices=("calibration", "development", "test", "all", "public"),
        default="all",
        help="calibration: the published Megatron runs the efficiency model was chosen on; development: public "
        "measured runs looked at while the model changed (in-sample; 'public' is its old name); test: runs committed "
        "before the estimators saw them and never tuned on, the honest figure; all: the three (default)",
    )
    v.add_argument("--case", metavar="ID", help="one run (PT01, T201, ...): its prediction, error and 80%% interval")
    v.add_argument(
        "--write-intervals",
        action="store_true",
        help="derive the residual table behind every estimate's 80%% interval from the development set and write it "
        "(lab/predict/data/intervals.json); the test split is never read",
    )
    v.add_argument(
        "--sensitivity",
        action="store_true",
        help="also price the development set and test split with each B or C graded constant (lab/predict/"
        "constants.py) swapped for its stated alternative: the change of each class's mean |err|",
    )
    command(v, cmd_validate)


def register(sub, common, hw, with_chip) -> None:
    _register_validate(sub, common, hw, with_chip)


__all__ = ["register"]
