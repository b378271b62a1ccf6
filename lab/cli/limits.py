"""``shardlab train limits``: the scaling book's data-, tensor- and FSDP-parallel thresholds on a chip, and the chips
that hold a job."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    check_checkpoints,
    command,
    dtype_arg,
    positive_float,
    positive_int,
)
from lab.cli.model_args import check_model_path
from lab.core.errors import UserError
from lab.core.models import resolve_model
from lab.core.table import render

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def cmd_train_limits(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    d_ff, model = args.d_ff, None
    if args.model is not None:  # read even when --d-ff overrides its d_ff: a bad name is an error, never ignored
        check_model_path(args.model)
        model = resolve_model(args.model)
        d_ff = d_ff or model.d_ff
    if args.checkpoints_per_layer is not None and (model is None or args.batch_tokens is None):
        raise UserError("--checkpoints-per-layer needs --model and --batch-tokens (the job whose memory it counts)")
    check_checkpoints(args.checkpoints_per_layer)
    # M_X and M_Y count physical torus axes (training.md); a switched fabric (NVLink, a host's threads) is one
    most = (chip.torus_dims or 1) if chip.topology == "torus" else 1
    for flag, v in (("--axes", args.axes), ("--tp-axes", args.tp_axes)):
        if v > most and chip.topology == "torus":
            raise UserError(f"{flag} {v}: {chip.name}'s torus has {most} axes; give 1 to {most}")
        if v > most:
            raise UserError(f"{flag} {v}: {chip.name}'s switched fabric ({chip.kind} node) is one axis; give 1")
    if args.batch_tokens is not None and args.chips is None and args.checkpoints_per_layer is None:
        raise UserError(
            f"--batch-tokens {args.batch_tokens} goes with --chips (the best FSDP degree) or --checkpoints-per-layer "
            "(the chips that hold the job); give one, or drop --batch-tokens"
        )
    if args.chips is not None:
        from lab.predict.planner.layouts import MAX_CHIPS

        if d_ff is None or args.batch_tokens is None:
            raise UserError(
                f"--chips {args.chips} sets the best FSDP degree, which also needs --batch-tokens and --d-ff (or "
                "--model); give them, or drop --chips"
            )
        if args.chips > MAX_CHIPS:
            raise UserError(f"--chips {args.chips} is more chips than any machine has; give at most {MAX_CHIPS}")
    from lab.predict.training.limits import limits

    lim = limits(
        chip,
        d_ff,
        axes=args.axes,
        tp_axes=args.tp_axes,
        chips=args.chips,
        batch_tokens=args.batch_tokens,
        dtype=args.dtype,
        model=model,
        checkpoints=args.checkpoints_per_layer,
    )
    rows = [
        ["alpha = C / W", f"{lim.alpha:.0f} FLOPs per byte"],
        ["DP/FSDP compute-bound above", f"{lim.dp_min_tokens_per_chip:,.0f} tokens per chip ({lim.axes} axis/axes)"],
        ["  across nodes / slices", f"{lim.dp_min_tokens_per_chip_cross_node:,.0f} tokens per chip"],
    ]
    if lim.dcn_min_tokens_per_slice:
        rows.append(["pure DP over DCN above", f"{lim.dcn_min_tokens_per_slice:,.0f} tokens per slice"])
    if lim.tp_max_degree is not None:
        rows += [
            ["TP compute-bound up to", f"{lim.tp_max_degree:.1f}-way (F = {d_ff})"],
            ["FSDP+TP compute-bound above", f"{lim.fsdp_tp_min_tokens_per_chip:,.0f} tokens per chip"],
        ]
    if lim.fsdp_opt_degree is not None:
        rows.append(["best FSDP degree", f"{lim.fsdp_opt_degree:.1f} (sqrt(B/F * M_X/M_Y * N))"])
    if lim.min_chips_to_hold is not None:
        said = (
            f"bf16 weights, fp32 Adam moments, {lim.checkpoints_per_layer:g} bf16 checkpoints of D per token and layer"
        )
        rows.append(["chips to hold the job", f"{lim.min_chips_to_hold:.1f} ({said})"])
    return lim.to_dict(), render(["threshold", "value"], rows, title=f"{chip.name}: the book's thresholds")


def register_limits(tsub, common, hw, with_chip) -> None:
    tl = tsub.add_parser("limits", parents=[common, hw], help="the book's DP, TP and FSDP thresholds")
    tl.add_argument("--model", metavar="NAME", help="take --d-ff from this model")
    tl.add_argument("--d-ff", type=positive_int("--d-ff"))
    tl.add_argument("--axes", type=positive_int("--axes"), default=1, help="ICI axes the DP/FSDP group spans (M_X)")
    tl.add_argument("--tp-axes", type=positive_int("--tp-axes"), default=1, help="ICI axes of the TP group (M_Y)")
    tl.add_argument("--chips", type=positive_int("--chips"))
    tl.add_argument("--batch-tokens", type=positive_int("--batch-tokens"))
    tl.add_argument("--dtype", type=dtype_arg, default="bf16")
    tl.add_argument(
        "--checkpoints-per-layer",
        type=positive_float("--checkpoints-per-layer", "3 or 4"),
        metavar="K",
        help="with --model and --batch-tokens: the chips whose HBM holds the job, the book's way (K saved [tokens, D] "
        "per layer, bf16 weights, fp32 Adam moments)",
    )
    command(tl, with_chip(cmd_train_limits))


__all__ = ["register_limits"]
