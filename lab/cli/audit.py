"""``shardlab audit``: compile a kernel or experiment's Plan and check its HLO against the estimate of that Plan."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from lab.cli.args import add_overwrite, add_target, command, out_path
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.plan import Plan, kernel_plan
from lab.core.programs import PROGRAMS, get_program
from lab.core.units import RUN_DTYPES

DEFAULT_MESH = {"X": 2, "Y": 4}
DEFAULT_MATMUL_SIZES = {"I": 512, "J": 1024, "K": 2048}
DEFAULT_BLOCK_SIZES = {"B": 512, "D": 1024, "F": 4096}
DEFAULT_COLLECTIVE_SIZES = {"N": 262144}
DEFAULT_ATTENTION_SIZES = {"B": 4, "T": 1024, "H": 8, "D": 64}
DEFAULT_ATTENTION_MESH = {"data": 2, "context": 4}
DEFAULT_MOE_SIZES = {"T": 1024, "D": 256, "F": 512, "E": 8}
DEFAULT_MOE_MESH = {"data": 2, "expert": 4}
DEFAULT_PIPELINE_SIZES = {"B": 64, "D": 256, "F": 1024, "L": 8, "M": 4}
DEFAULT_PIPELINE_MESH = {"data": 2, "pipe": 4}
DEFAULT_CIRCULAR_SIZES = {"B": 64, "D": 256, "F": 1024, "L": 16, "M": 4, "V": 2}


def _kernel_plan(name: str) -> Plan:
    spec = get_program(name)
    if spec.needs_model:
        raise UserError(
            f"{name} needs a model and sharding rules: audit an experiment file, e.g. "
            f"`shardlab audit experiments/{'decode_tp' if name == 'decode' else 'train_fsdp_tp'}.toml`"
        )
    default = {
        "collective": DEFAULT_COLLECTIVE_SIZES,
        "block": DEFAULT_BLOCK_SIZES,
        "attention": DEFAULT_ATTENTION_SIZES,
        "moe": DEFAULT_MOE_SIZES,
        "pipeline": DEFAULT_PIPELINE_SIZES,
    }.get(spec.family, DEFAULT_MATMUL_SIZES)
    if name == "pipeline_circular":
        default = DEFAULT_CIRCULAR_SIZES
    if name == "moe_shared_mlp":
        default = {**DEFAULT_MOE_SIZES, "S": 2}
    meshes = {"attention": DEFAULT_ATTENTION_MESH, "moe": DEFAULT_MOE_MESH, "pipeline": DEFAULT_PIPELINE_MESH}
    mesh = meshes.get(spec.family, DEFAULT_MESH)
    return kernel_plan(name, mesh, default, hardware="cpu")


def _with_flags(plan: Plan, args: argparse.Namespace) -> Plan:
    """The Plan with the command line's --mesh, --sizes, --dtype, --model, --axes and --hardware, checked again."""
    from lab.run.overrides import override

    plan, _ = override(plan, mesh=args.mesh, sizes=args.sizes, dtype=args.dtype, model=args.model)
    changes: dict[str, Any] = {}
    if args.axes is not None:
        axes = tuple(a.strip() for a in args.axes.split(","))
        if not all(axes):
            raise UserError(f"--axes {args.axes!r} has an empty name; give mesh axes separated by commas, e.g. X,Y")
        changes["axes"] = axes
    if args.hardware is not None:
        changes["hardware"] = args.hardware
    if changes:
        plan = dataclasses.replace(plan, **changes)
        plan.validate()
    return plan


def cmd_audit(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.run.environment import ensure_devices, require_devices

    target = args.target
    if target.endswith(".toml") or os.path.sep in target:
        from lab.run.experiment import load_experiment

        plan = load_experiment(target).plan
    else:
        plan = _kernel_plan(target)
    plan = _with_flags(plan, args)
    from lab.core.hardware import default_catalog

    topology = None
    if args.topology is not None:
        from lab.compile.target import parse_target, require_compiler

        topology = parse_target(args.topology)  # before JAX starts: a typo costs nothing
        require_compiler(topology)
        if args.hardware is None:  # priced on the topology's chip unless told otherwise
            plan = dataclasses.replace(plan, hardware=topology.chip)
    # "calibrated" prices with this host's calibration (the cpu entry, replaced by specs/cpu.json when present);
    # resolved before JAX starts, so a bad --hardware is refused at once
    chip = default_catalog(args.hardware_file).get("cpu" if plan.hardware == "calibrated" else plan.hardware)
    if topology is not None and plan.dtype not in chip.peak_flops:
        raise UserError(
            f"{topology.name} is priced on {chip.name}, which has no {plan.dtype} peak in the catalog; give --dtype "
            f"bf16 (TPUs multiply in bf16) or --hardware NAME"
        )
    if topology is None:
        ensure_devices(plan.devices)
        require_devices(plan.shape)
    else:
        from lab.compile.target import quiet_absent_tpu

        quiet_absent_tpu()

    if plan.spec.family == "user":  # nothing estimates it: what it compiled to
        from lab.compile.audit import inventory

        return inventory(plan, topology)
    from lab.compile.audit import audit_plan  # imports JAX
    from lab.core.heartbeat import still, to_terminal

    with still(to_terminal(), f"compiling and auditing {plan.name}"):
        result = audit_plan(plan, chip, topology)
    if args.hlo:
        try:
            Path(args.hlo).write_text(result.hlo_text)
        except OSError as exc:
            raise UserError(f"cannot write the HLO to {args.hlo!r}: {exc.strerror}") from None
    if args.strict and not result.all_match:
        args._exit_code = 1
    return result.to_dict(), result.table()


def cmd_audit_list(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.table import render

    specs = list(PROGRAMS.values())
    rows = [[s.name, s.family, s.notation or ",".join(s.dims), s.description] for s in specs]
    data = {
        "kernels": [
            {
                "name": s.name,
                "family": s.family,
                "notation": s.notation,
                "dims": list(s.dims),
                "description": s.description,
            }
            for s in specs
        ]
    }
    note = "\ntrain_step and decode need a model and sharding rules: audit them through an experiment file"
    return data, render(["kernel", "family", "notation / dims", "description"], rows) + note


def register(sub, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser(
        "audit",
        parents=[common],
        help=help_of("audit"),
    )
    a.add_argument(
        "target",
        metavar="KERNEL_OR_EXPERIMENT",
        nargs="?",
        help="a kernel name (see --list) or an experiments/*.toml file",
    )
    a.add_argument("--list", action="store_true", help="list the kernels")
    a.add_argument("--mesh", help=f"mesh axis sizes (default {','.join(f'{k}={v}' for k, v in DEFAULT_MESH.items())})")
    a.add_argument("--sizes", help="sizes, e.g. I=512,J=1024,K=2048 (collectives: N=elements per device; batch=16)")
    a.add_argument("--dtype", choices=RUN_DTYPES)
    a.add_argument(
        "--model",
        metavar="FIELD=VALUE,...",
        help="change the experiment's model, e.g. layers=2,d_model=1024 (base=llama3-8b starts from a catalog model)",
    )
    a.add_argument("--axes", help="collective microkernels: mesh axes to span, e.g. X,Y")
    a.add_argument("--hardware", metavar="NAME", help="chip to price expected collectives for (default cpu)")
    add_target(a)
    a.add_argument("--hlo", type=out_path("--hlo"), metavar="PATH", help="also write the optimized HLO text here")
    add_overwrite(a)
    a.add_argument("--strict", action="store_true", help="exit 1 when anything does not match")
    command(a, _dispatch)


def _dispatch(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.list:
        given = [repr(args.target)] if args.target is not None else []
        flags = ("mesh", "sizes", "dtype", "model", "axes", "hardware", "hlo", "topology")
        given += [f"--{'target' if k == 'topology' else k}" for k in flags if getattr(args, k) is not None]
        given += ["--strict"] if args.strict else []
        if given:  # they would be ignored: say so instead
            raise UserError(f"--list lists the kernels and takes nothing else; drop {', '.join(given)}")
        return cmd_audit_list(args)
    if not args.target:
        raise UserError(
            "name a kernel or an experiment file, e.g. `shardlab audit sharded_matmul_case2` "
            "(`shardlab audit --list` shows the kernels)"
        )
    if not re.fullmatch(r"[\w./\-]+", args.target):
        raise UserError(f"{args.target!r} is neither a kernel name nor a .toml path")
    return cmd_audit(args)


__all__ = ["cmd_audit", "cmd_audit_list", "register"]
