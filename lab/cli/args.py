"""What every command group shares: the parser class, argument types, the chip and model from flags.

Each command module (``analytic``, ``train``, ``infer``, ``audit``, ``run``) imports from here and from nowhere
else in ``lab.cli``; ``main`` imports them all. So the command line has no import cycles.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import NoReturn

from lab.core.errors import UserError
from lab.core.hardware import Chip, default_catalog, scale_chip
from lab.core.models import ModelConfig, resolve_model
from lab.core.notation import parse_positive_int
from lab.core.units import canonical_dtype, dtype_bytes


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if "invalid choice" in message or "required" in message:
            hint = f" (see: {self.prog} --help)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def positive_int(what: str):
    def conv(s: str) -> int:
        try:
            return parse_positive_int(s, what)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = what
    return conv


def dtype_arg(s: str) -> str:
    try:
        return canonical_dtype(s)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_bytes(text: str) -> float:
    """``33554432``, ``32Mi``, ``1e6`` or an array such as ``bf16[2048,8192]`` -> bytes."""
    s = str(text).strip()
    m = re.fullmatch(r"([A-Za-z0-9_]+)\[([0-9,\s]+)\]", s)
    if m:
        dt = canonical_dtype(m.group(1))
        dims = [parse_positive_int(x, "--bytes dim") for x in m.group(2).split(",") if x.strip()]
        n = 1
        for d in dims:
            n *= d
        return n * dtype_bytes(dt)
    try:
        return float(parse_positive_int(s, "--bytes"))
    except UserError:
        raise UserError(
            f"--bytes: {text!r} is not a byte count; use e.g. 33554432, 32Mi, 1e6 or bf16[2048,8192]"
        ) from None


def axis_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_positive_int(x, "--axis-size") for x in str(text).split(","))


def chip_of(args: argparse.Namespace) -> Chip:
    chip = default_catalog(args.hardware_file).get(args.hardware)
    scale = getattr(args, "scale", None)
    return scale_chip(chip, scale) if scale else chip


def with_chip(fn):
    """Adapt ``fn(args, chip)`` to the ``func(args)`` that main() calls."""

    def run(args: argparse.Namespace):
        return fn(args, chip_of(args))

    return run


MODEL_FLAGS = (
    "layers",
    "d_model",
    "d_ff",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "tied_embeddings",
    "experts",
    "experts_per_token",
    "gated_mlp",
)


def model_parent(positional: bool) -> argparse.ArgumentParser:
    """--model NAME (or a positional NAME) plus the custom-model flags."""
    p = argparse.ArgumentParser(add_help=False)
    if positional:
        p.add_argument("model", nargs="?", metavar="NAME", help="catalog model or a .toml file (see `model list`)")
    else:
        p.add_argument("--model", metavar="NAME", help="catalog model or a .toml file; flags below override it")
    g = p.add_argument_group("custom model")
    for flag in ("layers", "d-model", "d-ff", "heads", "kv-heads", "head-dim", "vocab", "experts", "experts-per-token"):
        g.add_argument(f"--{flag}", type=int, metavar="N")
    g.add_argument("--tied-embeddings", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--gated-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SwiGLU MLP with 3 matrices (default for custom models) or a 2-matrix GeLU MLP",
    )
    return p


def _model(args: argparse.Namespace) -> ModelConfig:
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS}
    for k, v in overrides.items():
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
            raise UserError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
    return resolve_model(args.model, overrides)


def model_of(args: argparse.Namespace) -> ModelConfig:
    """The model a command's ``--model`` and custom-model flags describe."""
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS}
    for k, v in overrides.items():
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
            raise UserError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
    return resolve_model(args.model, overrides)


PLAN_CONFLICTS = (
    "model",
    "chips",
    "dp",
    "fsdp",
    "tp",
    "pp",
    "cp",
    "global_batch",
    "batch_tokens",
    "seq_len",
    "batch",
    "context",
    "prefill_len",
    "generate",
)


def plan_of(args: argparse.Namespace, program: str, command: str):
    """``(plan, chip)`` of ``--plan FILE``: the experiment file's Plan, priced on its hardware or ``--hardware``.

    Raises:
        UserError: the file describes another program, or a flag that the Plan already gives is set too.
    """
    import sys

    from lab.run.experiment import load_experiment

    given = [f"--{k.replace('_', '-')}" for k in PLAN_CONFLICTS if getattr(args, k, None) is not None]
    given += [f"--{k.replace('_', '-')}" for k in MODEL_FLAGS if getattr(args, k, None) is not None]
    if given:
        raise UserError(f"{', '.join(given)} with --plan: the Plan gives the model, layout and sizes; drop them")
    plan = load_experiment(args.plan).plan
    if plan.program != program:
        other = {"train_step": "train estimate", "decode": "infer estimate"}.get(plan.program, "shardlab audit")
        raise UserError(f"--plan {args.plan} runs {plan.program}; {command} prices {program} (try `{other}`)")
    if args.hardware:  # re-targeted: the Plan priced is the Plan with this chip
        plan = dataclasses.replace(plan, hardware=args.hardware)
    name = plan.hardware
    catalog = default_catalog(args.hardware_file)
    chip = catalog.get("cpu" if name == "calibrated" else name)
    if name == "calibrated" and not chip.calibrated:
        print(
            "shardlab: warning: no calibration of this host yet: pricing with the catalog's uncalibrated cpu entry "
            "(`shardlab calibrate`, or --hardware NAME)",
            file=sys.stderr,
        )
    scale = getattr(args, "scale", None)
    return plan, (scale_chip(chip, scale) if scale else chip)


def ops_table(program) -> str:
    """The estimate's named ops: the same list ``shardlab run`` joins to what ran."""
    from lab.core.table import render
    from lab.core.units import fmt_bytes, fmt_count, fmt_seconds

    rows = [
        [
            o.name,
            o.kind,
            ",".join(o.axes) or "-",
            fmt_seconds(o.time_s) + (f" ({o.hidden})" if o.hidden else ""),
            f"{o.calls:g}",
            fmt_bytes(o.bytes) if o.is_collective else (fmt_count(o.flops) if o.flops else "-"),
        ]
        for o in program.ops
    ]
    return render(["named op", "kind", "axes", "time per step (hidden behind)", "calls", "bytes / FLOPs"], rows)


def common_parent() -> argparse.ArgumentParser:
    """``--json`` and ``--hardware-file``, which every command takes."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    common.add_argument(
        "--hardware-file",
        metavar="FILE",
        help="TOML or JSON file adding or overriding chips (same format calibration writes)",
    )
    return common


def hardware_parent(required: bool = True) -> argparse.ArgumentParser:
    """``--hardware NAME`` and ``--scale`` what-ifs."""
    hw = argparse.ArgumentParser(add_help=False)
    hw.add_argument(
        "--hardware",
        required=required,
        metavar="NAME",
        help="chip name or alias (tpu-v5e, v5e, h100, a100, cpu...); see `shardlab hardware list`",
    )
    hw.add_argument(
        "--scale",
        metavar="FIELD=X,...",
        help="what-if: multiply chip fields, e.g. hbm_bandwidth=2,flops=1.5,ici_bandwidth=0.5",
    )
    return hw


__all__ = [
    "MODEL_FLAGS",
    "Parser",
    "axis_sizes",
    "chip_of",
    "common_parent",
    "dtype_arg",
    "hardware_parent",
    "model_of",
    "model_parent",
    "ops_table",
    "parse_bytes",
    "plan_of",
    "positive_int",
    "with_chip",
]
