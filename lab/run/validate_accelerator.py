"""``scripts/validate_accelerator``: calibrate whatever backend is here, run the real-size experiments, and write
``docs/validation/<chip>.md`` with the raw ``report.json`` files beside it.

Per op class (matmul, attention, each collective, elementwise) the record gives the median and the interquartile
spread of measured / predicted twice: with the catalog spec of this device kind and with the spec calibrated a
minute earlier (the same measured times, the compiled ops priced again with :func:`lab.report.ledger.predict_ops`
on the catalog chip); and the train step's MFU against the catalog peak. On emulated CPU devices (its test) the
experiments run scaled to the host (``--scale-to-host``) and everything is labelled emulated.
"""

from __future__ import annotations

import datetime
import json
import shutil
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from lab.core.table import render

EXPERIMENTS = ("llama3_8b_train_2layer", "llama3_8b_decode")
ROOT = Path(__file__).resolve().parents[2]


def _calibrate(quick: bool, say) -> tuple[str, str]:
    """Calibrate this backend (the host, or the devices); ``(catalog chip name, spec path)``."""
    import jax

    from lab.core.devices import chip_for_device

    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    if backend == "cpu":
        from lab.measure.calibrate import calibrate, write_spec

        mesh = {"X": 2, "Y": 4} if jax.device_count() >= 8 else {"X": jax.device_count()}
        path = write_spec(calibrate(mesh, quick=quick, progress=say, force=True))
        return "cpu", str(path)
    from lab.measure.calibrate_device import calibrate_device, write_device_spec

    chip, warnings = calibrate_device({"X": jax.device_count()}, quick=quick, progress=say)
    for w in warnings:
        say(f"warning: {w}")
    return chip_for_device(kind), str(write_device_spec(chip))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def op_classes(report: dict[str, Any], catalog_chip) -> list[dict[str, Any]]:
    """Per op class: ops, median and quartiles of measured/predicted with the calibrated spec and the catalog's."""
    from lab.report.ledger import predict_ops

    hlo = (Path(report["run_dir"]) / "hlo.txt").read_text()
    plan = report["plan"]
    slow = (
        tuple(a["name"] for a in plan["mesh"] if a.get("link") == "slow") if isinstance(plan.get("mesh"), list) else ()
    )
    catalog = {p.name: p.predicted_s for p in predict_ops(hlo, catalog_chip, report["mesh"], slow)}
    by_class: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"calibrated": [], "catalog": []})
    for op in report["ops"]:
        if not op["measured_s"] or not op["predicted_s"]:
            continue
        c = by_class[op["kind"]]
        c["calibrated"].append(op["measured_s"] / op["predicted_s"])
        if catalog.get(op["name"]):
            c["catalog"].append(op["measured_s"] / catalog[op["name"]])
    out = []
    for kind, ratios in sorted(by_class.items()):
        row: dict[str, Any] = {"class": kind, "ops": len(ratios["calibrated"])}
        for spec, xs in ratios.items():
            if xs:
                lo, mid, hi = _quartiles(xs)
                row[spec] = {"median": mid, "p25": lo, "p75": hi}
        out.append(row)
    return out


def mfu(report: dict[str, Any], peaks: dict[str, float]) -> float | None:
    """The train step's model FLOPs per device over the measured step and the peak of its dtype (the catalog's
    on an accelerator; on emulated devices the host's calibrated one, since the catalog's cpu is a placeholder)."""
    if report["kernel"] != "train_step" or not report["step_time_measured_s"]:
        return None
    dtype = "bf16" if report["dtype"] in ("bf16", "bfloat16") else report["dtype"]
    peak = peaks.get(dtype) or max(peaks.values())
    return report["estimate"]["flops"] / (report["step_time_measured_s"] * peak)


def _run(name: str, out: Path, emulated: bool, say) -> dict[str, Any]:
    from lab.run.pipeline import run_experiment

    say(f"running {name}" + (" scaled to this host" if emulated else ""))
    result = run_experiment(
        str(ROOT / "experiments" / f"{name}.toml"), str(out), quiet=True, scale_to_host=emulated, run_id=name
    )
    return result.report | {"run_dir": str(result.run_dir)}


def _fmt(x: dict[str, float] | None) -> str:
    return f"{x['median']:.2f} [{x['p25']:.2f}, {x['p75']:.2f}]" if x else "-"


def markdown(chip_name: str, env: dict[str, Any], spec_path: str, rows: dict[str, Any]) -> str:
    """The record: what ran where, then per experiment the op classes and the MFU."""
    emulated = env["backend"] == "cpu"
    lines = [
        f"# Validation on {env['device_count']} {env['backend']} devices ({env['device_kind']})"
        + (" - EMULATED" if emulated else ""),
        "",
        f"Written by `scripts/validate_accelerator` on {datetime.date.today().isoformat()}; jax "
        f"{env['versions'].get('jax')}; calibrated spec `{spec_path}`; catalog spec `{chip_name}`.",
    ]
    if emulated:
        lines += [
            "",
            "Emulated CPU devices: the experiments ran scaled to this host (`--scale-to-host`), timings are "
            "against a host calibration, and none of this is an accelerator's figure.",
        ]
    peak_of = "the host's calibrated peak" if emulated else "the catalog's peak"
    for name, r in rows.items():
        scaled = r["report"].get("scaled_to_host") or {}
        lines += ["", f"## {name}", ""]
        if scaled.get("factor", 1) > 1:
            lines.append(f"Scaled by 1/{scaled['factor']} to fit this host. ")
        m = r["mfu"]
        lines.append(
            f"Step measured {r['report']['step_time_measured_s']:.4g} s; estimated "
            f"{r['report']['step_time_estimated_s']:.4g} s"
            + (f"; MFU {100 * m:.1f}% of {peak_of}" if m is not None else "")
            + f". Raw report: `{name}/report.json`."
        )
        table = [[c["class"], c["ops"], _fmt(c.get("calibrated")), _fmt(c.get("catalog"))] for c in r["classes"]]
        lines += [
            "",
            "measured / predicted per op class, median [25th, 75th percentile]:",
            "",
            "```",
            render(["op class", "ops", "calibrated spec", "catalog spec"], table),
            "```",
        ]
    return "\n".join(lines) + "\n"


def validate_accelerator(
    out_doc: str | None = None,
    runs: str = "runs/validate_accelerator",
    quick: bool = False,
    experiments: tuple[str, ...] = EXPERIMENTS,
    say=print,
) -> Path:
    """Calibrate, run, write the record and copy the raw reports beside it; the record's path."""
    from lab.core.hardware import default_catalog
    from lab.run.environment import environment

    chip_name, spec_path = _calibrate(quick, say)
    env = environment()
    catalog_chip = default_catalog().get(chip_name) if chip_name != "cpu" else _placeholder_cpu()
    rows = {}
    for name in experiments:
        report = _run(name, Path(runs), env["backend"] == "cpu", say)
        peaks = report["hardware"]["peak_flops"] if env["backend"] == "cpu" else catalog_chip.peak_flops
        rows[name] = {"report": report, "classes": op_classes(report, catalog_chip), "mfu": mfu(report, peaks)}
    slug = "cpu-emulated" if env["backend"] == "cpu" else chip_name
    doc = Path(out_doc) if out_doc else ROOT / "docs" / "validation" / f"{slug}.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    raw = doc.parent / doc.stem
    for name, r in rows.items():
        (raw / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(r["report"]["run_dir"]) / "report.json", raw / name / "report.json")
    summary = {n: {"classes": r["classes"], "mfu": r["mfu"]} for n, r in rows.items()}
    (raw / "summary.json").write_text(json.dumps(summary, indent=2))
    doc.write_text(markdown(chip_name, env, spec_path, rows))
    say(f"wrote {doc} and the raw reports under {raw}/")
    return doc


def _placeholder_cpu():
    """The catalog's own cpu entry (not this host's calibration): the 'catalog spec' column on a host."""
    from lab.core.hardware import Catalog

    return Catalog().get("cpu")


__all__ = ["EXPERIMENTS", "markdown", "mfu", "op_classes", "validate_accelerator"]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from lab.core.errors import UserError

    p = argparse.ArgumentParser(prog="scripts/validate_accelerator", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="quick calibration (fewer sizes and repeats)")
    p.add_argument("--doc", help="the record's path (default docs/validation/<chip>.md)")
    p.add_argument("--runs", default="runs/validate_accelerator", help="where the runs go")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS), help="experiment names, comma-separated")
    args = p.parse_args(argv)
    names = tuple(n.strip() for n in args.experiments.split(",") if n.strip())
    unknown = [n for n in names if not (ROOT / "experiments" / f"{n}.toml").is_file()]
    if unknown or not names:
        print(
            f"shardlab: error: --experiments {args.experiments!r}: no experiments/{(unknown or [''])[0]}.toml; "
            f"e.g. {','.join(EXPERIMENTS)}",
            file=sys.stderr,
        )
        return 2
    try:
        validate_accelerator(
            args.doc, args.runs, args.quick, names, say=lambda s: print(f"[validate] {s}", file=sys.stderr)
        )
    except UserError as exc:
        print(f"shardlab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
