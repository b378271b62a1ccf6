"""``shardlab audit``: compile a kernel or experiment on a mesh and compare its HLO with the prediction."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from lab.core.errors import UserError
from lab.core.notation import parse_mesh, parse_sizes

DEFAULT_MESH = {"X": 2, "Y": 4}
DEFAULT_MATMUL_SIZES = {"I": 512, "J": 1024, "K": 2048}
DEFAULT_COLLECTIVE_SIZES = {"N": 262144}


def ensure_host_devices(n: int) -> None:
    """Before JAX starts: emulate at least ``n`` CPU devices unless the user chose a count already."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags and n <= 256:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(8, n)}".strip()


def cmd_audit(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.run.experiment import load_experiment

    target = args.target
    if target.endswith(".toml") or os.path.sep in target:
        exp = load_experiment(target)
        kernel, mesh, sizes, dtype, axes = exp.kernel, exp.mesh, exp.sizes, exp.dtype, exp.axes
        hardware = exp.hardware
    else:
        kernel, mesh, sizes, dtype, axes, hardware = target, None, None, None, None, "cpu"
    if args.mesh:
        mesh = parse_mesh(args.mesh)
    if args.sizes:
        sizes = parse_sizes(args.sizes)
    if args.dtype:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(args.dtype, args.dtype)
    if args.axes:
        axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    if args.hardware:
        hardware = args.hardware
    mesh = mesh or dict(DEFAULT_MESH)
    dtype = dtype or "fp32"
    if dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype {dtype!r} is not one of float32, bfloat16")
    if kernel.startswith(("sharded_matmul", "collective_matmul", "matmul_")) and "Y" not in mesh:
        mesh = {**mesh, "Y": 1}  # matmul kernels name X and Y; a 1-D mesh has Y of size 1
    ensure_host_devices(math.prod(mesh.values()))

    if kernel in ("train_step", "decode"):
        return _audit_model(exp if target.endswith(".toml") else None, kernel, mesh, sizes)

    from kernels.registry import get_kernel  # imports JAX
    from lab.compile.audit import audit_kernel
    from lab.core.hardware import default_catalog

    k = get_kernel(kernel)
    if sizes is None:
        sizes = dict(DEFAULT_COLLECTIVE_SIZES if k.family == "collective" else DEFAULT_MATMUL_SIZES)
    if axes is not None:
        for a in axes:
            if a not in mesh:
                raise UserError(f"--axes names {a!r}, which is not a mesh axis ({', '.join(mesh)})")
    # "calibrated" prices with this host's calibration (the cpu entry, replaced by specs/cpu.json when present)
    chip = default_catalog(args.hardware_file).get("cpu" if hardware == "calibrated" else hardware)
    result = audit_kernel(kernel, mesh, sizes, dtype, axes, chip=chip)
    if args.hlo:
        try:
            Path(args.hlo).write_text(result.hlo_text)
        except OSError as exc:
            raise UserError(f"cannot write the HLO to {args.hlo!r}: {exc.strerror}") from None
    data = result.to_dict()
    if args.strict and not result.all_match:
        args._exit_code = 1
    return data, result.table()


def _audit_model(exp, kernel: str, mesh: dict[str, int], sizes: dict[str, int] | None):
    if kernel == "decode" or exp is None:
        raise UserError(
            "the audit predicts the Transformer's train step from an experiment file "
            "(e.g. experiments/train_fsdp_tp.toml); decode has no plan-level prediction yet, use shardlab run"
        )
    from kernels.transformer import TransformerConfig
    from lab.compile.model_audit import audit_train

    try:
        cfg = TransformerConfig(**exp.model, compute_dtype="bfloat16" if exp.dtype == "bf16" else "float32")
    except TypeError as exc:
        raise UserError(f"{exp.path}: [model] {exc}") from None
    sizes = sizes or exp.sizes
    result = audit_train(
        cfg, str(exp.run.get("rules", "fsdp_tp")), mesh, sizes["batch"], sizes["seq"], str(exp.run.get("remat", "none"))
    )
    return result.to_dict(), result.table()


def cmd_audit_list(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.table import render

    ensure_host_devices(8)
    from kernels.registry import KERNELS

    rows = [[k.name, k.family, k.notation or ",".join(k.dims), k.description] for k in KERNELS.values()]
    data = {
        "kernels": [
            {
                "name": k.name,
                "family": k.family,
                "notation": k.notation,
                "dims": list(k.dims),
                "description": k.description,
            }
            for k in KERNELS.values()
        ]
    }
    return data, render(["kernel", "family", "notation / dims", "description"], rows)


def register(sub, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser(
        "audit",
        parents=[common],
        help="compile a kernel or experiment and check its collectives and FLOPs against the prediction",
    )
    a.add_argument(
        "target",
        metavar="KERNEL_OR_EXPERIMENT",
        nargs="?",
        help="a kernel name (see --list) or an experiments/*.toml file",
    )
    a.add_argument("--list", action="store_true", help="list the kernels")
    a.add_argument("--mesh", help=f"mesh axis sizes (default {','.join(f'{k}={v}' for k, v in DEFAULT_MESH.items())})")
    a.add_argument("--sizes", help="kernel dims, e.g. I=512,J=1024,K=2048 (collectives: N=elements per device)")
    a.add_argument("--dtype", choices=("float32", "bfloat16", "fp32", "bf16"))
    a.add_argument("--axes", help="collective microkernels: mesh axes to span, e.g. X,Y")
    a.add_argument("--hardware", metavar="NAME", help="chip to price predicted collectives for (default cpu)")
    a.add_argument("--hlo", metavar="PATH", help="also write the optimized HLO text here")
    a.add_argument("--strict", action="store_true", help="exit 1 when anything does not match")
    a.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.list:
        return cmd_audit_list(args)
    if not args.target:
        raise UserError(
            "name a kernel or an experiment file, e.g. `shardlab audit sharded_matmul_case2` "
            "(`shardlab audit --list` shows the kernels)"
        )
    if not re.fullmatch(r"[\w./\-]+", args.target):
        raise UserError(f"{args.target!r} is neither a kernel name nor a .toml path")
    return cmd_audit(args)
