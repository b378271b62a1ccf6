"""``shardlab run`` and ``shardlab calibrate`` (registered by :mod:`lab.cli.main`)."""

from __future__ import annotations

import argparse
from typing import Any

from lab.core.errors import UserError


def cmd_run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.run.pipeline import ensure_devices, run_experiment

    if args.devices is not None:
        ensure_devices(args.devices)
    result = run_experiment(
        args.experiment,
        args.out,
        resume=args.resume,
        quiet=args.quiet or args.json,
        hardware=args.hardware,
        hardware_file=args.hardware_file,
        run_id=args.run_id,
    )
    r = result.report
    if "points" in r:
        from lab.core.table import render
        from lab.core.units import fmt_seconds

        rows = [
            [
                p["label"],
                fmt_seconds(p["step_time_predicted_s"]),
                fmt_seconds(p["step_time_measured_s"] or 0),
                f"{100 * p['coverage']:.0f}%",
                f"{p['median_ratio_large']:.2f}" if p["median_ratio_large"] else "-",
                {True: "yes", False: "NO", None: "-"}[p["all_match"]],
            ]
            for p in r["points"]
        ]
        text = render(
            ["point", "predicted step", "measured step", "coverage", "median ratio >= 1 MB", "audit"],
            rows,
            title=f"{r['experiment']}: {len(rows)} points" + (" (emulated)" if r["emulated"] else ""),
        )
        return r | {"run_dir": str(result.run_dir)}, text + f"\n\nreports under {result.run_dir}/points/"
    return r | {"run_dir": str(result.run_dir)}, run_text(result)


def run_text(result) -> str:
    """The ledger and where the files are, for one finished run."""
    from lab.core.units import fmt_seconds
    from lab.report.writer import ledger_table

    r = result.report
    hw = r["hardware"]
    ratio = r["summary"]["median_ratio_large"]
    cal = "a host-calibrated spec" if hw.get("calibrated") else "an UNCALIBRATED spec"
    emulated = f" (EMULATED: timings vs {cal}, structure exact)" if r["emulated"] else ""
    verdict = {True: "all match", False: "MISMATCH", None: "not predicted"}[r["audit"].get("all_match")]
    large = f"median measured/predicted {ratio:.2f}" if ratio else "none"
    lines = [
        f"{r['experiment']} on {r['devices']} {r['backend']} devices{emulated}",
        f"spec {hw['name']} (calibrated: {hw.get('calibrated', False)}); audit: {verdict}",
        f"step: measured {fmt_seconds(r['step_time_measured_s'] or 0)}, predicted "
        f"{fmt_seconds(r['step_time_predicted_s'])}; coverage {100 * r['coverage']:.1f}%; ops of 1 MB or more: {large}",
        "",
        ledger_table(r["ops"], limit=15),
        "",
        f"report: {result.run_dir}/report.md (report.json, ops.csv, roofline.png, predicted_vs_measured.png, "
        "breakdown.png)",
        f"trace:  tensorboard --logdir {r['tensorboard']}",
    ]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.notation import parse_mesh
    from lab.run.pipeline import Progress, ensure_devices

    mesh = parse_mesh(args.mesh)
    n = 1
    for v in mesh.values():
        n *= v
    ensure_devices(n)
    import jax

    backend = jax.default_backend()
    if backend != "cpu":  # the fits below assume threads of one host; an accelerator needs its own
        kind = jax.devices()[0].device_kind
        raise UserError(
            f"calibrate measures the emulated CPU host, not {backend} devices ({kind!r}); on {backend}, "
            "`shardlab run` prices with the catalog chip of that device kind, or name one with --hardware"
        )
    if jax.device_count() < n:
        raise UserError(f"--mesh {args.mesh} needs {n} devices but {jax.device_count()} are available")
    from lab.measure.calibrate import calibrate, write_spec

    cal = calibrate(mesh, quick=args.quick, progress=None if (args.quiet or args.json) else Progress())
    path = write_spec(cal, args.out)
    return cal.to_dict() | {"path": str(path)}, cal.table() + f"\n\nwrote {path}"


def register(sub, common: argparse.ArgumentParser) -> None:
    from lab.cli.main import _positive_int

    r = sub.add_parser(
        "run", parents=[common], help="predict, compile+audit, profile, compare and report an experiment"
    )
    r.add_argument("experiment", metavar="EXPERIMENT", help="an experiments/*.toml file")
    r.add_argument(
        "--devices", type=_positive_int("--devices"), help="emulated host devices (CPU; default: the mesh's)"
    )
    r.add_argument("--out", default="runs", help="parent folder of the run directory (default runs/)")
    r.add_argument("--run-id", help="name of the run directory (default: the experiment's name, or with a timestamp)")
    r.add_argument("--resume", action="store_true", help="continue an interrupted sweep in the same run directory")
    r.add_argument("--hardware", metavar="NAME", help="price with this catalog chip instead of the calibration")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("calibrate", parents=[common], help="fit this backend's spec from microbenchmarks")
    c.add_argument("--out", metavar="PATH", help="where to write the spec (default specs/<backend>.json)")
    c.add_argument("--mesh", default="X=2,Y=4", help="mesh for the collective fits (default X=2,Y=4)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 15 s)")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_calibrate)
