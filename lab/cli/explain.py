"""``shardlab explain``: the compiled program read back in the Plan's names (``explain memory``: what fills memory at
its peak, role by role, beside the estimator's memory model)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lab.cli.args import add_overwrite, add_target, chart_path, command, in_path, write_chart
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
    if args.dtype is not None:
        plan, _ = override(plan, dtype=args.dtype)
    target = None
    if args.topology is not None:
        from lab.compile.target import parse_target, require_libtpu

        target = parse_target(args.topology)
        require_libtpu()
        plan = dataclasses.replace(plan, hardware=target.chip)
    chip = default_catalog().get("cpu" if plan.hardware == "calibrated" else plan.hardware)
    if target is not None and plan.dtype not in chip.peak_flops:
        raise UserError(
            f"{target.name} is priced on {chip.name}, which has no {plan.dtype} peak in the catalog; give --dtype "
            "bf16 (TPUs multiply in bf16)"
        )
    return plan, target, chip


def cmd_memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    plan, target, chip = _plan_and_chip(args)
    if plan.spec.family == "user":
        raise UserError(f"{args.experiment}: explain memory reads Plans the lab builds; a user model has no roles")
    if target is None:
        from lab.run.environment import ensure_devices, require_devices

        ensure_devices(plan.devices)
        require_devices(plan.shape)
    else:
        from lab.compile.target import quiet_absent_tpu

        quiet_absent_tpu()
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


def register(sub, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser("explain", help=help_of("explain"))
    what = e.add_subparsers(dest="what", required=True, parser_class=type(e), metavar="WHAT")
    m = what.add_parser(
        "memory",
        parents=[common],
        help="the buffers live at the compiled program's peak, by role, beside the estimator's memory model",
    )
    m.add_argument("experiment", metavar="EXPERIMENT", type=in_path("EXPERIMENT"), help="an experiments/*.toml file")
    m.add_argument("--dtype", choices=RUN_DTYPES, help="compute dtype (default: the experiment's)")
    add_target(m)
    m.add_argument(
        "--png", type=chart_path("--png"), metavar="PATH", help="also draw the memory timeline (stacked by role)"
    )
    add_overwrite(m)
    command(m, cmd_memory)


__all__ = ["cmd_memory", "register"]
