"""``shardlab run``, ``shardlab calibrate`` and ``shardlab demo``: the commands that run programs."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from lab.cli.args import add_calls, add_overwrite, add_target, folder_path, out_path, positive_int, text_arg
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.table import render
from lab.core.units import RUN_DTYPES

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"  # the checkout's shipped experiments


def cmd_run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.run.pipeline import run_experiment

    result = run_experiment(
        args.experiment,
        args.out,
        resume=args.resume,
        quiet=args.quiet or args.json,
        hardware=args.hardware,
        hardware_file=args.hardware_file,
        run_id=args.run_id,
        compile_only=args.compile_only,
        devices=args.devices,
        distributed=args.distributed,
        target=args.topology,
        overrides={
            "mesh": args.mesh,
            "sizes": args.sizes,
            "dtype": args.dtype,
            "model": args.model,
            "warmup": args.warmup,
            "repeats": args.repeats,
        },
        scale_to_host=args.scale_to_host,
    )
    r = result.report
    if "rank" in r:  # a process other than 0: its trace and a small JSON
        return r | {"run_dir": str(result.run_dir)}, (
            f"process {r['rank']}: wrote {result.run_dir}/report.json and its trace; process 0 writes the report"
        )
    if "points" in r:
        return r | {"run_dir": str(result.run_dir)}, sweep_text(result)
    return r | {"run_dir": str(result.run_dir)}, run_text(result)


def sweep_text(result) -> str:
    """One line per point of a sweep, and where the reports are."""
    from lab.core.table import render
    from lab.core.units import fmt_seconds

    r = result.report

    def s(x):
        return fmt_seconds(x) if x is not None else "-"

    rows = [
        [
            p["label"],
            s(p.get("step_time_estimated_s")),
            s(p["step_time_predicted_s"]),
            s(p["step_time_measured_s"]),
            f"{100 * p['coverage']:.0f}%",
            f"{p['median_ratio_large']:.2f}" if p["median_ratio_large"] else "-",
            {True: "yes", False: "NO", None: "-"}[p["all_match"]],
        ]
        for p in r["points"]
    ]
    text = render(
        ["point", "estimated", "predicted", "measured", "coverage", "median ratio >= 1 MB", "audit"],
        rows,
        title=f"{r['experiment']}: {len(rows)} points" + (" (emulated)" if r["emulated"] else ""),
    )
    drawn = ", sweep.png" if (result.run_dir / "sweep.png").is_file() else ""
    return text + f"\n\nsummary: {result.run_dir}/summary.md{drawn}; each point's report under {result.run_dir}/points/"


def _coverage_line(r: dict, large: str) -> str:
    """How much of the measured time the predictions cover; a compiled-only run says nothing ran instead of 0%."""
    if r.get("compile_only"):
        from lab.report.writer import compiled_where

        return f"{compiled_where(r)}: nothing ran, so no measured times and no coverage"
    cover = r.get("estimate_coverage")
    return (
        f"coverage {100 * r['coverage']:.1f}% of measured op time in predicted ops"
        + (f" ({100 * cover:.0f}% of matmul and collective time in estimated ops)" if cover is not None else "")
        + f"; ops of 1 MB or more: {large}"
    )


def run_text(result) -> str:
    """The three step times, the named ops and the heaviest HLO ops, and where the files are, for one run."""
    from lab.core.paths import runnable
    from lab.core.units import fmt_seconds
    from lab.report.trust import spec_words, verdict_words
    from lab.report.writer import compiled_where, ledger_table, named_table, trust_of

    r = result.report
    hw = r["hardware"]
    ratio = r["summary"]["median_ratio_large"]
    cal = "a host-calibrated spec" if hw.get("calibrated") else "an UNCALIBRATED spec"
    trust = trust_of(r)
    emulated = f" (EMULATED: timings vs {cal}, structure exact)" if r["emulated"] else ""
    verdict = {True: "all match", False: "MISMATCH", None: "not estimated"}[r["audit"].get("all_match")]
    large = f"median measured/predicted {ratio:.2f}" if ratio else "none"

    def s(x):
        return fmt_seconds(x) if x is not None else "-"

    scaled = r.get("scaled_to_host")
    lines = [
        f"{r['experiment']} on {r['devices']} {r['backend']} devices{emulated}"
        + (f" ({compiled_where(r)}: nothing ran)" if r.get("compiled_for") else ""),
        *(
            [f"SCALED to this host by 1/{scaled['factor']} (--scale-to-host; sizes in the report)"]
            if scaled and scaled["factor"] > 1
            else []
        ),
        f"spec {spec_words(hw)}; audit against the estimate: {verdict}",
        f"step: estimated {s(r['step_time_estimated_s'])}, predicted {s(r['step_time_predicted_s'])}, measured "
        f"{s(r['step_time_measured_s'])}; {verdict_words(trust)}",
        _coverage_line(r, large),
    ]
    if r.get("routing"):
        from lab.report.writer import routing_line

        lines.append(f"routing: {routing_line(r['routing'])}")
    if r.get("pipeline_bubble"):
        from lab.report.writer import bubble_line

        lines.append(f"pipeline bubble: {bubble_line(r['pipeline_bubble'])}")
    if r.get("processes"):
        steps = ", ".join(
            f"{p['rank']} ({p['host']}, {p['local_devices']} devices) {s(p['step_time_measured_s'])}"
            for p in r["processes"]
        )
        lines.append(f"processes: {steps}; slowest {r['slowest_process']} (its ops are the ledger's measured)")
        if r["emulated"]:
            lines.append("(between emulated processes collectives go through gloo on loopback, not DCN)")
    if r.get("estimated_ops"):
        lines += ["", named_table(r["estimated_ops"], limit=12)]
    lines += ["", ledger_table(r["ops"], limit=10 if r.get("estimated_ops") else 15), ""]
    if r.get("serving"):  # a serve run's load: the engine beside the scheduler priced by the step's estimate
        from lab.report.serving import table

        lines += [
            f"serving {r['serving']['measured']['requests']} requests (measured: the engine; predicted: the "
            "scheduler on the step's estimate plus the host's work per step):",
            table(r["serving"]),
            "",
        ]
    if r.get("compile_only"):
        lines.append(f"compiled only (no profile): {result.run_dir}/report.md, report.json, ops.csv, hlo.txt")
    else:
        lines += [
            f"report: {result.run_dir}/report.md (report.json, ops.csv, roofline.png, predicted_vs_measured.png, "
            "breakdown.png" + (", serving.png)" if r.get("serving") else ")"),
            f"trace:  {runnable('tensorboard')} --logdir {r['tensorboard']}",
        ]
    return "\n".join(lines)


def cmd_launch(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.run.launch import json_report, launch

    run_args = [a for a in args.run_args if a != "--json"]
    json_out = args.json or len(run_args) < len(args.run_args)
    args.json = json_out
    from lab.run.experiment import check_calls

    run = args.run_parser.parse_args([args.experiment, *run_args])  # a bad run option: refused here, not N times
    check_calls({"warmup": run.warmup, "repeats": run.repeats}, run.compile_only)
    if "--resume" in run_args:
        raise UserError("--resume continues a run of one process; launch the processes again without it")
    if args.port is not None and not 1024 <= args.port <= 65535:
        raise UserError(
            f"--port {args.port} is not a port launch can use; give one from 1024 to 65535, or leave it out"
        )
    if args.hardware_file:  # given before the experiment, it belongs to the processes' runs
        run_args = ["--hardware-file", args.hardware_file, *run_args]
    done = launch(args.local_processes, args.experiment, run_args, port=args.port, json_out=json_out)
    if done.code:
        args._exit_code = done.code
        if done.code == 2:  # the process's user error: the same exit code and one line naming the process
            raise UserError(done.message)
        print(f"shardlab: error: {done.message}", file=sys.stderr)
        return {"error": done.message, "failed_rank": done.failed_rank}, ""
    if json_out:
        try:
            return json_report(done.stdout), ""
        except ValueError as exc:
            head, tail = done.stdout[:200], done.stdout[-200:]
            raise UserError(f"process 0 printed no JSON report ({exc}; begins {head!r}, ends {tail!r})") from None
    return {}, done.message


def cmd_calibrate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.notation import parse_mesh
    from lab.run.environment import Progress, ensure_devices

    if getattr(args, "hardware_file", None):
        raise UserError("calibrate measures this host and reads no chip file; drop --hardware-file")
    if args.out is not None and Path(args.out).suffix.lower() != ".json":
        raise UserError(f"--out {args.out!r}: the spec is written as JSON; give a path ending in .json")
    args.mesh_given = args.mesh is not None
    args.mesh = args.mesh if args.mesh is not None else "X=2,Y=4"
    mesh = parse_mesh(args.mesh)
    n = 1
    for v in mesh.values():
        n *= v
    from lab.run.environment import MAX_EMULATED

    if n > MAX_EMULATED:
        raise UserError(
            f"--mesh {args.mesh} needs {n} devices; calibrate emulates at most {MAX_EMULATED} (try X=2,Y=4)"
        )
    ensure_devices(n)
    import jax

    backend = jax.default_backend()
    if backend != "cpu":  # an accelerator: device-side trace times (lab.measure.calibrate_device)
        return _calibrate_device(args)
    if jax.device_count() < n:
        raise UserError(f"--mesh {args.mesh} needs {n} devices but {jax.device_count()} are available")
    from lab.measure.calibrate import calibrate, check_writable, write_spec

    check_writable(args.out)  # before a minute of measuring, not after
    say = None if (args.quiet or args.json) else Progress()
    cal = calibrate(mesh, quick=args.quick, progress=say, force=args.force)
    path = write_spec(cal, args.out)
    # the lab's own Transformer step against the new spec: the op factors the microbenchmarks cannot see
    from lab.run.calibrate_step import apply, measure_step

    if say is not None:
        say("last step: the lab's Transformer train step on every device, priced against the new spec")
    found = measure_step(path, n, args.quick, say)
    apply(path, found)
    rows = [[k, f"{v:.2f}"] for k, v in found["op_factor"].items()]
    step = found["op_factor_step"]
    text = render(["op kind", "measured / estimated"], rows, title=f"the lab's Transformer step: {step['program']}")
    data = cal.to_dict() | {"path": str(path), "op_factor": found["op_factor"], "op_factor_step": step}
    return data, cal.table() + "\n\n" + text + f"\n\nwrote {path}"


def _calibrate_device(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``shardlab calibrate`` on a GPU or TPU: every device in one mesh axis unless --mesh says otherwise."""
    import jax

    from lab.core.notation import parse_mesh
    from lab.core.table import render
    from lab.core.units import fmt_rate, fmt_seconds
    from lab.measure.calibrate_device import calibrate_device, write_device_spec
    from lab.run.environment import Progress

    n = jax.device_count()
    mesh = parse_mesh(args.mesh) if args.mesh_given else {"X": n}
    if math.prod(mesh.values()) > n:
        raise UserError(f"--mesh {args.mesh} needs {math.prod(mesh.values())} devices; this machine has {n}")
    say = None if (args.quiet or args.json) else Progress()
    chip, warnings = calibrate_device(mesh, quick=args.quick, progress=say)
    for w in warnings:
        print(f"shardlab: warning: {w}", file=sys.stderr)
    path = write_device_spec(chip, args.out)
    rows = [[f"peak {dt}", fmt_rate(v, "FLOP/s")] for dt, v in chip.peak_flops.items()]
    rows += [
        ["HBM bandwidth", fmt_rate(chip.hbm_bandwidth, "B/s")],
        ["link bandwidth", fmt_rate(chip.link_bandwidth, "B/s")],
    ]
    rows += [["collective latency", fmt_seconds(chip.launch_latency_s)]]
    text = render(["term", "calibrated"], rows, title=f"{chip.name} calibrated on {n} {jax.default_backend()} devices")
    return chip.fields() | {"path": str(path), "warnings": warnings}, text + f"\n\nwrote {path}"


def cmd_demo(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import os

    from lab.run.demo import run_demo
    from lab.run.environment import ensure_devices

    if args.backend == "cpu" and "jax" not in sys.modules:  # the emulated mesh, whatever accelerator is here
        os.environ["JAX_PLATFORMS"] = "cpu"
    ensure_devices(8)  # before the placement check starts JAX: the demo's mesh, however shardlab was started
    if args.analytic_only and args.out is not None:
        raise UserError("--out names where the run goes, and --analytic-only runs nothing; drop one of them")
    report = run_demo(hardware=args.hardware, hardware_file=args.hardware_file)
    if args.analytic_only:
        return report.data, report.text
    from lab.run.pipeline import run_experiment

    experiment = EXPERIMENTS / "tp_mlp.toml"
    job = main_job()
    result = run_experiment(
        str(experiment),
        args.out or "runs",
        quiet=args.json,
        hardware_file=args.hardware_file,
        overrides=job["overrides"],
    )
    shown = experiment.relative_to(Path.cwd()) if experiment.is_relative_to(Path.cwd()) else experiment
    flags = "".join(f" --{k} {v}" for k, v in job["overrides"].items() if v)
    head = f"\n\n5. The main job {job['where']}: shardlab run {shown}{flags}\n"
    data = report.data | {"run": result.report | {"run_dir": str(result.run_dir)}, "backend": job["backend"]}
    return data, report.text + head + run_text(result)


def main_job() -> dict[str, Any]:
    """Where the demo's main job runs: the toy MLP block on 8 emulated CPU devices, or on an accelerator the
    LLaMA-3-8B-sized block of sections 1-3 in bf16 over the devices there are (X=2,Y=4 with 8, else Y=all)."""
    import jax

    backend, n = jax.default_backend(), jax.device_count()
    if backend == "cpu":
        return {"backend": "cpu", "where": "on the emulated mesh", "overrides": {}}
    from lab.run.demo import D_FF, D_MODEL, TOKENS

    mesh = "X=2,Y=4" if n >= 8 else f"X=1,Y={n}"
    sizes = f"B={TOKENS},D={D_MODEL},F={D_FF}"
    where = f"on {n} {backend} device{'s' if n > 1 else ''} ({jax.devices()[0].device_kind})"
    return {"backend": backend, "where": where, "overrides": {"mesh": mesh, "sizes": sizes, "dtype": "bf16"}}


def register(sub, common: argparse.ArgumentParser) -> None:
    """Add ``run``, ``calibrate`` and ``demo`` to the ``shardlab`` parser."""
    r = _register_run(sub, common)
    _register_launch(sub, common, r)
    _register_calibrate(sub, common)
    _register_demo(sub, common)


def _register_run(sub, common):
    r = sub.add_parser("run", parents=[common], help=help_of("run"))
    r.add_argument("experiment", metavar="EXPERIMENT", help="an experiments/*.toml file")
    r.add_argument("--devices", type=positive_int("--devices"), help="emulated host devices (CPU; default: the mesh's)")
    r.add_argument(
        "--out", default="runs", type=folder_path("--out"), help="parent folder of the run directory (default runs/)"
    )
    r.add_argument(
        "--run-id",
        type=text_arg("--run-id", "a plain name such as my-run"),
        help="name of the run directory (default: the experiment's name, or with a timestamp)",
    )
    r.add_argument("--resume", action="store_true", help="continue an interrupted sweep in the same run directory")
    r.add_argument(
        "--hardware",
        metavar="NAME",
        type=text_arg("--hardware", "a catalog name (shardlab hardware list)"),
        help="price with this catalog chip instead of the calibration",
    )
    r.add_argument(
        "--compile-only",
        action="store_true",
        help="estimate, compile and audit without profiling (a Plan that does not fit is a warning, not an error)",
    )
    r.add_argument("--mesh", metavar="AXIS=N,...", help="the mesh instead of the experiment's, e.g. data=1,model=8")
    r.add_argument("--sizes", metavar="DIM=N,...", help="sizes to change, e.g. batch=16,seq=2048")
    r.add_argument("--dtype", choices=RUN_DTYPES, help="the compute dtype")
    r.add_argument(
        "--model",
        metavar="FIELD=VALUE,...",
        help="change the experiment's model, e.g. layers=2,d_model=1024 (base=llama3-8b starts from a catalog model)",
    )
    add_calls(
        r,
        "untraced calls before the profiled ones, instead of the experiment's (its [run] warmup, default 10)",
        "profiled calls, instead of the experiment's (its [run] repeats, default 5): more for a steadier median per op",
    )
    r.add_argument(
        "--scale-to-host",
        action="store_true",
        help="on emulated CPU devices, divide widths and lengths by the smallest power of two that fits this host "
        "(printed, and recorded in the report)",
    )
    add_target(r, "with --compile-only: ")
    r.add_argument(
        "--distributed",
        action="store_true",
        help="one of several processes: join JAX's distributed runtime (found as jax.distributed.initialize() finds "
        "it on TPU VMs, SLURM and Open MPI; detected there without this flag)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.set_defaults(func=cmd_run)
    return r


def _register_launch(sub, common, r) -> None:
    la = sub.add_parser(
        "launch",
        parents=[common],
        help=help_of("launch"),
    )
    la.add_argument(
        "--local-processes", type=positive_int("--local-processes"), required=True, metavar="N", help="processes"
    )
    la.add_argument("--port", type=positive_int("--port"), help="the coordinator's port on 127.0.0.1 (default: free)")
    la.add_argument("experiment", metavar="EXPERIMENT", help="an experiments/*.toml file")
    la.add_argument("run_args", nargs=argparse.REMAINDER, metavar="[RUN OPTIONS]", help="passed to `shardlab run`")
    la.set_defaults(func=cmd_launch, run_parser=r)


def _register_calibrate(sub, common) -> None:
    c = sub.add_parser("calibrate", parents=[common], help=help_of("calibrate"))
    c.add_argument(
        "--out",
        metavar="PATH",
        type=out_path("--out"),
        help="where to write the spec, a .json file (default specs/cpu.json)",
    )
    add_overwrite(c, force_alias=False)  # calibrate's --force keeps a busy host's calibration
    c.add_argument(
        "--mesh",
        default=None,
        help="mesh for the collective fits (default X=2,Y=4 emulated; on an accelerator every device in one axis)",
    )
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 12 s on an idle 2-core host)")
    c.add_argument(
        "--force", action="store_true", help="keep a calibration taken on a busy host (marked so in the spec)"
    )
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_calibrate)


def _register_demo(sub, common) -> None:
    d = sub.add_parser("demo", parents=[common], help=help_of("demo"))
    d.add_argument("--hardware", default="tpu-v5e", metavar="NAME", help="target chip to predict for")
    d.add_argument("--analytic-only", action="store_true", help="skip the run (compile, profile, ledger)")
    d.add_argument("--out", type=folder_path("--out"), help="parent folder of the run directory (default runs/)")
    d.add_argument(
        "--backend",
        choices=("auto", "cpu"),
        default="auto",
        help="auto (default): the accelerator when JAX finds one, else 8 emulated CPU devices; cpu: always emulate",
    )
    d.set_defaults(func=cmd_demo)


__all__ = ["cmd_calibrate", "cmd_demo", "cmd_launch", "cmd_run", "register", "run_text", "sweep_text"]
