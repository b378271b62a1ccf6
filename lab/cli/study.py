"""``shardlab study``: hardware generations and memory technologies, with their charts."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    MAX_SEQ_LEN,
    Parser,
    add_overwrite,
    chart_path,
    command,
    positive_float,
    positive_int,
    scale_arg,
    write_chart,
)
from lab.cli.commands import help_of
from lab.cli.model_args import check_model_path
from lab.core.errors import UserError

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

MAX_STACKS = 32  # HBM stacks on one package: 8 today (B200, MI300X), 16 announced (Rubin Ultra); 32 leaves room


def cmd_study_generations(args: argparse.Namespace) -> tuple[dict[str, Any], str]:

    from lab.studies.generations import generations

    check_model_path(args.model)
    if args.seq_len > MAX_SEQ_LEN:
        raise UserError(
            f"--seq-len {args.seq_len} is longer than any model's context; give at most {MAX_SEQ_LEN:,} (e.g. 2048)"
        )
    study = generations(
        args.model, chips=args.chips, tokens=args.tokens, seq_len=args.seq_len, global_batch=args.global_batch
    )
    png = write_chart(args.png, f"runs/study/generations_{study.model}.png", study.plot)
    d = study.to_dict() | {"png": png}
    return d, study.table() + f"\n\nchart: {png}"


def _study_memtech(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.studies.memtech import memory_tech

    check_model_path(args.model)
    if args.stacks is not None and args.stacks > MAX_STACKS:
        raise UserError(
            f"--stacks {args.stacks}: no package carries that many HBM stacks (8 on B200 and MI300X, 16 announced "
            f"for Rubin Ultra); give 1 to {MAX_STACKS}, or leave it out for the chip's own"
        )
    study = memory_tech(
        args.model,
        args.hardware,
        stacks=args.stacks,
        context=args.context,
        batch=args.batch,
        tp=args.tp,
        weights=args.weights,
        kv=args.kv,
        hardware_file=args.hardware_file,
        scale=args.scale,
    )
    rows = study.to_dict()["rows"]
    if args.batch is not None and not any(r["fits"] for r in rows):
        most = max(r["max_batch"] for r in rows)
        raise UserError(
            f"--batch {args.batch} fits none of the memory technologies of {study.hardware} at --context "
            f"{args.context}; give at most {most}, or leave --batch out (the largest that fits each)"
        )
    png = write_chart(args.png, f"runs/study/memory_tech_{study.model}_{study.hardware}.png", study.plot)
    return study.to_dict() | {"png": png}, study.table() + f"\n\nchart: {png}"


def _unfit_row(key: str, row) -> bool:
    """A memory-tech row where the model does not fit has no step time (``inf``) and no speed-up."""
    return row.get("fits") is False and key in ("decode_step_s", "speedup_vs_first", "efficiency")


def _register_study(sub, common, hw, with_chip) -> None:
    st = sub.add_parser("study", help=help_of("study"))
    ssub = st.add_subparsers(
        dest="study_command", required=True, parser_class=Parser, metavar="generations|memory-tech"
    )
    sg = ssub.add_parser(
        "generations",
        parents=[common],
        help="one model's training time on A100, H100, H200 and B200 systems of one size",
    )
    sg.add_argument("--model", default="gpt3-175b", metavar="NAME")
    sg.add_argument("--chips", type=positive_int("--chips"), default=1024)
    sg.add_argument("--tokens", type=positive_float("--tokens", "3e11"), default=300e9)
    sg.add_argument("--seq-len", type=positive_int("--seq-len"), default=2048)
    sg.add_argument("--global-batch", type=positive_int("--global-batch"), default=1536)
    sg.add_argument(
        "--png",
        type=chart_path("--png"),
        metavar="PATH",
        help="bar chart (default: runs/study/generations_<model>.png)",
    )
    add_overwrite(sg)
    command(sg, cmd_study_generations)
    sm = ssub.add_parser(
        "memory-tech",
        parents=[common],
        help="decode latency and throughput against HBM generations and on-chip bandwidth",
    )
    sm.add_argument("--model", default="llama3-70b", metavar="NAME")
    sm.add_argument("--hardware", default="h100", metavar="NAME")
    sm.add_argument("--scale", type=scale_arg, metavar="FIELD=X,...")
    sm.add_argument("--stacks", type=positive_int("--stacks"), help="HBM stacks (default: the chip's own)")
    sm.add_argument("--context", type=positive_int("--context"), default=8192)
    sm.add_argument("--batch", type=positive_int("--batch"), help="fixed batch (default: the largest that fits)")
    sm.add_argument("--tp", type=positive_int("--tp"), default=8)
    sm.add_argument("--weights", choices=("bf16", "fp8", "int8", "int4"), default="bf16")
    sm.add_argument("--kv", choices=("bf16", "fp8", "int8", "int4"), default="bf16")
    sm.add_argument("--png", type=chart_path("--png"), metavar="PATH")
    add_overwrite(sm)
    command(sm, _study_memtech, allowed=_unfit_row)


def register(sub, common, hw, with_chip) -> None:
    _register_study(sub, common, hw, with_chip)


__all__ = ["register"]
