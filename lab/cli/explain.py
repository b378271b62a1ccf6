"""``shardlab explain``: the compiled program read back in the Plan's names (``explain memory``: what fills memory at
its peak, role by role, beside the estimator's memory model; ``explain overlap``: what the schedule, and a run's
trace, put beside each collective, against what the estimator assumed hidden; ``explain sharding``: where the rules
put each array and which rule and source line each compiled collective comes from)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from lab.cli.args import (
    add_overwrite,
    add_target,
    chart_path,
    command,
    in_path,
    positive_int,
    text_arg,
    write_chart,
)
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.units import RUN_DTYPES


def _plan_and_chip(args: argparse.Namespace):
    """The experiment's Plan (with ``--dtype``), its TPU target if any, and the chip its estimate is priced on;
    everything checked before JAX starts."""
    from lab.core.hardware import default_catalog
    from lab.run.experiment import load_experiment
    from lab.run.overrides import override

    if not str(args.experiment).endswith(".toml"):
        raise UserError(f"{args.experiment!r} is not an experiment file; give one such as experiments/train_dp.toml")
    plan = load_experiment(args.experiment).plan
    if args.dtype is not None or args.mesh is not None:
        plan, _ = override(plan, dtype=args.dtype, mesh=args.mesh)
    target = None
    if args.topology is not None:
        from lab.compile.target import parse_target, require_compiler

        target = parse_target(args.topology)
        require_compiler(target)
        plan = dataclasses.replace(plan, hardware=target.chip)
    chip = default_catalog().get("cpu" if plan.hardware == "calibrated" else plan.hardware)
    if target is not None and plan.dtype not in chip.peak_flops:
        raise UserError(
            f"{target.name} is priced on {chip.name}, which has no {plan.dtype} peak in the catalog; give --dtype "
            "bf16 (TPUs multiply in bf16)"
        )
    return plan, target, chip


def _devices(plan, target) -> None:
    """The host's emulated devices for a program compiled here; for a TPU target, libtpu told there are none."""
    if target is None:
        from lab.run.environment import ensure_devices, require_devices

        ensure_devices(plan.devices)
        require_devices(plan.shape)
    else:
        from lab.compile.target import quiet_absent_tpu

        quiet_absent_tpu()


def cmd_memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.hbm is not None and not args.fit:
        raise UserError("--hbm is the memory --fit fits into; give --fit with it, or leave --hbm out")
    if args.fit and args.png is not None:
        raise UserError("--png draws the peak of the Plan as written; leave it out with --fit (or run without --fit)")
    plan, target, chip = _plan_and_chip(args)
    if plan.spec.family == "user":
        raise UserError(f"{args.experiment}: explain memory reads Plans the lab builds; a user model has no roles")
    _devices(plan, target)
    if args.fit:
        return _fit(plan, target, chip, args.hbm)
    from lab.compile.memory import explain_memory  # imports JAX
    from lab.core.heartbeat import still, to_terminal

    with still(to_terminal(), f"compiling {plan.name or plan.program} and reading XLA's memory plan"):
        result = explain_memory(plan, chip, target)
    data, text = result.to_dict(), result.table()
    if args.png is not None:
        from lab.report.memory_plot import plot_timeline

        data["png"] = write_chart(args.png, args.png, lambda p: plot_timeline(result, p))
        text += f"\nmemory timeline: {data['png']}"
    return data, text


def _fit(plan, target, chip, hbm: float | None) -> tuple[dict[str, Any], str]:
    """``explain memory --fit``: the ladder of fixes compiled until one fits, and the largest batch per remat
    policy (:func:`lab.compile.fit.fit_ladder`), instead of the peak of the Plan as written."""
    from lab.compile.fit import fit_ladder  # imports JAX
    from lab.core.heartbeat import still, to_terminal

    with still(to_terminal(), f"compiling the ladder of fixes of {plan.name or plan.program} until one fits"):
        result = fit_ladder(plan, chip, target, hbm)
    return result.to_dict(), result.table()


def _run_files(folder: str, plan) -> tuple[dict[str, Any], str]:
    """A finished run's report and the HLO it ran, checked to be a run of the Plan's program on its mesh (before JAX
    starts)."""
    where = Path(folder)
    if not where.is_dir():
        raise UserError(f"--run {folder!r} is not a folder; give a finished run's folder such as runs/train_dp")
    try:
        report = json.loads((where / "report.json").read_text(encoding="utf-8"))
        hlo = (where / "hlo.txt").read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise UserError(f"--run {folder!r} is not a finished run (its report.json and hlo.txt): {exc}") from None
    if not isinstance(report, dict) or report.get("compile_only") or not (where / "tensorboard").is_dir():
        raise UserError(f"--run {folder!r} has no profiler trace (a --compile-only run?); give a run that ran")
    mesh, ran = report.get("mesh"), report.get("kernel")
    if ran != plan.program or mesh != dict(plan.shape) or report.get("experiment") not in (None, plan.name):
        raise UserError(
            f"--run {folder!r} ran {report.get('experiment') or ran} ({ran} on mesh {mesh}), not {plan.name} "
            f"({plan.program} on {dict(plan.shape)}); give a run of the same experiment"
        )
    return report, hlo


def _run(folder: str, report: dict[str, Any], hlo: str):
    """The run as :func:`lab.compile.overlap.explain_overlap` reads it: its trace's op events, and the estimator's
    view of its program from its own audit and estimate (the join the run made)."""
    from lab.compile.hlo import module_name, parse_module
    from lab.compile.overlap import Run, estimator_view
    from lab.core.collective_kinds import KINDS
    from lab.measure import trace

    names = {i.name for instrs in parse_module(hlo).computations.values() for i in instrs}
    got = trace.parse(Path(folder) / "tensorboard", hlo_names=names, module=module_name(hlo))
    audit, estimate = report.get("audit") or {}, report.get("estimate") or {}
    ops = {
        o["name"]: (o["time_s"], o.get("hidden"), o["bytes"]) for o in estimate.get("ops", []) if o.get("kind") in KINDS
    }
    assumed = estimator_view(audit.get("entries", []), ops, hlo)
    return Run(hlo, dict(report["mesh"]), assumed, got.events, got.backend, report.get("pipeline_bubble"))


def cmd_overlap(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    plan, target, chip = _plan_and_chip(args)
    files = _run_files(args.run, plan) if args.run is not None else None
    _devices(plan, target)
    from lab.compile.overlap import explain_overlap  # imports JAX
    from lab.core.collective_kinds import HLO_NAMES
    from lab.core.heartbeat import still, to_terminal
    from lab.report.ledger import predict_ops

    def price(text: str) -> dict[str, float]:  # the ledger's roofline of each compute op, one execution
        ops = predict_ops(text, chip, plan.shape, plan.slow_axes)
        return {p.name: p.predicted_s for p in ops if p.kind not in HLO_NAMES}

    with still(to_terminal(), f"compiling {plan.name or plan.program} and reading its schedule"):
        run = _run(args.run, *files) if files is not None else None
        result = explain_overlap(plan, chip, target, price, run)
    return result.to_dict(), result.table()


def cmd_sharding(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    plan, target, _ = _plan_and_chip(args)
    if plan.program not in ("train_step", "decode"):
        raise UserError(
            f"{args.experiment}: explain sharding reads the Transformer's train_step and decode, which sharding rules "
            f"place; this experiment runs {plan.program}"
        )
    _devices(plan, target)
    from lab.compile.sharding import explain_sharding  # imports JAX
    from lab.core.heartbeat import still, to_terminal

    with still(to_terminal(), f"compiling {plan.name or plan.program} and tracing its collectives to the rules"):
        result = explain_sharding(plan, target)
    return result.to_dict(), result.table()


def _program_args(p: argparse.ArgumentParser) -> None:
    """What every explain subcommand compiles: an experiment file, its dtype and mesh, a TPU or GPU target."""
    p.add_argument("experiment", metavar="EXPERIMENT", type=in_path("EXPERIMENT"), help="an experiments/*.toml file")
    p.add_argument("--dtype", choices=RUN_DTYPES, help="compute dtype (default: the experiment's)")
    p.add_argument(
        "--mesh", metavar="AXIS=N,...", help="the mesh instead of the experiment's, e.g. data=4,model=4 for v6e:4x4"
    )
    add_target(p)


def register(sub, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser("explain", help=help_of("explain"))
    what = e.add_subparsers(dest="what", required=True, parser_class=type(e), metavar="WHAT")
    m = what.add_parser(
        "memory",
        parents=[common],
        help="the buffers live at the compiled program's peak, by role, beside the estimator's memory model",
    )
    _program_args(m)
    m.add_argument(
        "--png", type=chart_path("--png"), metavar="PATH", help="also draw the memory timeline (stacked by role)"
    )
    m.add_argument(
        "--fit",
        action="store_true",
        help="instead: compile the ladder of fixes (remat selective, full, a smaller microbatch, more FSDP, the next "
        "topology) until one fits the chip's memory, and the largest batch per remat policy, beside the estimator's",
    )
    m.add_argument(
        "--hbm",
        type=positive_int("--hbm"),
        metavar="BYTES",
        help="with --fit: the memory per device to fit (e.g. 16e9, 512Mi; default: the chip's HBM)",
    )
    add_overwrite(m)
    command(m, cmd_memory)
    o = what.add_parser(
        "overlap",
        parents=[common],
        help="what the compiled schedule (and a run's trace) puts beside each collective, against what the estimator "
        "assumed hidden",
    )
    _program_args(o)
    o.add_argument(
        "--run",
        metavar="RUN_DIR",
        type=text_arg("--run", "a run folder such as runs/train_dp", kind="folder"),
        help="a finished run of the experiment (shardlab run): also what its trace measured",
    )
    command(o, cmd_overlap)
    sh = what.add_parser(
        "sharding",
        parents=[common],
        help="per array its logical dims, mesh axes, bytes per device and what replicates it; every compiled "
        "collective traced to the rule and the source line that cause it",
    )
    _program_args(sh)
    command(sh, cmd_sharding)


__all__ = ["cmd_memory", "cmd_overlap", "cmd_sharding", "register"]
