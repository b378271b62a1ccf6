"""``shardlab plan``: every layout, remat policy and microbatch priced and ranked; with ``--validate K``, the best K
that the lab's train step runs compiled, run and ranked again by what they measure."""

from __future__ import annotations

import argparse
import dataclasses

from lab.cli.args import (
    add_calls,
    add_target,
    command,
    folder_path,
    positive_int,
)
from lab.cli.commands import help_of
from lab.cli.model_args import model_of, model_parent
from lab.cli.train import BATCH_TOKENS_HELP
from lab.core.errors import UserError
from lab.core.units import NUMPY_NAME, numpy_name
from lab.predict.training.estimate import OPTIMIZERS

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def cmd_plan(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    from lab.predict.planner.layouts import plan

    model = model_of(args)
    seq = args.seq_len or model.max_seq_len
    calls = {"warmup": args.warmup, "repeats": args.repeats}
    given = [f"--{k}" for k, v in calls.items() if v is not None]
    if args.validate is None and (args.topology is not None or args.out is not None or given):
        raise UserError(
            "--target, --out, --warmup and --repeats belong to --validate K "
            "(compile and run the planner's best layouts)"
        )
    if args.topology is not None and given:
        raise UserError(f"{' and '.join(given)} time the layouts run on this host; --target only compiles: drop them")
    if args.validate is not None:
        _check_validate(args)
    top = args.top if args.validate is None else max(args.top, 500)  # enough to find K the train step runs
    result = plan(model, chip, args.chips, args.batch_tokens, seq, top=top, dtype=args.dtype, optimizer=args.optimizer)
    shown = dataclasses.replace(result, top=result.top[: args.top])
    if args.validate is None:
        return result.to_dict(), result.table()
    from lab.run.plan_validate import table, validate_plan

    dtype = numpy_name(args.dtype) if args.dtype in NUMPY_NAME else "float32"
    calls = {k: v for k, v in calls.items() if v is not None}
    out = args.out or "runs/plan"
    data = validate_plan(result, model, chip, args.validate, out, target=args.topology, dtype=dtype, **calls)
    return shown.to_dict() | {"validation": data}, shown.table() + "\n\n" + table(data)


def _check_validate(args: argparse.Namespace) -> None:
    """--validate K: the devices it runs on (emulated ones prepared before JAX starts), or the TPU topology."""
    from lab.run.environment import MAX_EMULATED, ensure_devices

    if args.topology is not None:
        from lab.compile.target import parse_target, require_libtpu

        t = parse_target(args.topology)
        if t.backend != "tpu":
            raise UserError(f"plan --target {t.name}: the planner compiles for TPU topologies (v5e:2x4, ...)")
        if t.chips != args.chips:
            raise UserError(f"--target {t.name} has {t.chips} chips; give --chips {t.chips}")
        require_libtpu()
        return
    if args.chips > MAX_EMULATED:
        raise UserError(f"--validate runs on this host's devices; --chips {args.chips} is more than it can emulate")
    ensure_devices(args.chips, exact=True)


def _register_plan(sub, common, hw, with_chip) -> None:
    pl = sub.add_parser(
        "plan",
        parents=[common, hw, model_parent(positional=False)],
        help=help_of("plan"),
    )
    pl.add_argument("--chips", type=positive_int("--chips"), required=True)
    pl.add_argument("--batch-tokens", type=positive_int("--batch-tokens"), required=True, help=BATCH_TOKENS_HELP)
    pl.add_argument("--seq-len", type=positive_int("--seq-len"), help="default: the model's context")
    pl.add_argument("--top", type=positive_int("--top"), default=10)
    pl.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    pl.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    pl.add_argument(
        "--validate",
        type=positive_int("--validate"),
        metavar="K",
        help="compile and run the K best layouts the train step executes, and compare the rankings",
    )
    add_target(pl, "with --validate: ", gpus=False)
    pl.add_argument("--out", type=folder_path("--out"), help="with --validate: where the runs go (default runs/plan)")
    add_calls(
        pl,
        "with --validate on this host: untraced calls of each layout's step before the profiled ones (default 3)",
        "with --validate on this host: profiled calls of each layout's step (default 5); more for a steadier "
        "measured ranking",
    )
    command(pl, with_chip(cmd_plan))


def register(sub, common, hw, with_chip) -> None:
    _register_plan(sub, common, hw, with_chip)


__all__ = ["register"]
