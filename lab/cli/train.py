"""Command line for the model catalog and the training estimator (registered by :mod:`lab.cli.main`)."""
# Over 500 lines on purpose: the train command group: the estimate's forty flags, each beside the check that refuses its
# bad combinations.

from __future__ import annotations

import argparse
import math

from lab.cli.args import (
    Parser,
    add_overwrite,
    check_checkpoints,
    chip_of,
    command,
    fraction,
    hardware_parent,
    in_path,
    nonneg_int,
    out_path,
    positive_float,
    positive_int,
    positive_ints,
    warn,
)
from lab.cli.commands import help_of
from lab.cli.model_args import model_of, model_parent, ops_table, plan_of, plan_options
from lab.core.errors import UserError
from lab.core.table import render
from lab.core.units import fmt_count, fmt_seconds, fmt_share
from lab.predict.intervals import for_training
from lab.predict.intervals import text as interval_text
from lab.predict.training.config import ELEMENTWISE, GRAD_REDUCE, uneven_stages
from lab.predict.training.estimate import OPTIMIZERS, SCHEDULES, Layout, TrainConfig, estimate
from lab.predict.training.remat import ALL as REMAT_ALL

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

GiB = 2**30
# The job's options an experiment file's Plan gives instead ([options], its dtype), refused next to --plan
TRAIN_OPTIONS = (
    "microbatch",
    "ep",
    "zero",
    "sequence_parallel",
    "pp_schedule",
    "interleave",
    "capacity_factor",
    "pp_split",
    "pp_embedding_slots",
    "remat",
    "checkpoints_per_layer",
    "dtype",
    "optimizer",
    "flash_attention",
    "attention_kernel",
    "elementwise",
    "tp_comm_overlap",
    "zero_shard",
    "no_dp_overlap",
    "dp_bucket_mb",
    "grad_reduce",
)
MIN_MFU = 1e-3  # an MFU below 0.1% is a typo: large training runs reach 0.3-0.6 (the calibration set's Megatron runs)
# A whole number of sequences: 4Mi = 4,194,304 = 512 x 8192 divides by every power-of-two --seq-len (4M does not)
BATCH_TOKENS_HELP = "tokens per optimizer step, all sequences together: a multiple of --seq-len (e.g. 4Mi or 4194304)"


def _layout(args: argparse.Namespace) -> Layout:
    chips = args.chips
    given = {k: getattr(args, k) for k in ("dp", "fsdp", "tp", "pp", "cp")}
    if args.interleave != 1 and args.pp_schedule != "interleaved":
        raise UserError(
            f"--interleave {args.interleave} only applies to --pp-schedule interleaved (got {args.pp_schedule}); "
            "add --pp-schedule interleaved, or drop --interleave"
        )
    if all(v is None for v in given.values()):
        given["fsdp"] = chips  # default: weights, gradients and optimizer sharded over every chip
    known = math.prod(v for v in given.values() if v is not None)
    if given["dp"] is None and given["fsdp"] is None:
        if chips % known:
            raise UserError(
                f"--chips {chips} is not a multiple of tp x pp x cp = {known}; "
                f"try --chips {max(known, chips // known * known)}"
            )
        given["dp"] = chips // known  # the remaining devices, MaxText's -1
    degrees = {k: (v or 1) for k, v in given.items()}
    if math.prod(degrees.values()) != chips:
        parts = " x ".join(f"{k}={v}" for k, v in degrees.items() if v > 1) or "1"
        raise UserError(
            f"{parts} = {math.prod(degrees.values())} chips but --chips is {chips}; "
            f"make the degrees multiply to {chips} (leave --dp out to fill the rest)"
        )
    _check_layout_flags(args, degrees)
    return Layout(
        **degrees,
        ep=args.ep,
        zero=args.zero,
        zero_shard=args.zero_shard or 0,
        sequence_parallel=args.sequence_parallel,
        pp_schedule=args.pp_schedule,
        interleave=args.interleave,
        pp_embedding_slots=args.pp_embedding_slots,
        stage_split=tuple(args.pp_split or ()),
    )


def _check_layout_flags(args: argparse.Namespace, degrees: dict[str, int]) -> None:
    """Refuse a flag the layout makes meaningless (it would only change the estimate's label)."""
    if degrees["pp"] == 1:
        pipeline = [
            f
            for f, given in (
                (f"--pp-schedule {args.pp_schedule}", args.pp_schedule != "1f1b"),
                ("--pp-split", args.pp_split is not None),
                ("--pp-embedding-slots", args.pp_embedding_slots),
            )
            if given
        ]
        if pipeline:
            raise UserError(f"{', '.join(pipeline)} applies to a pipeline; add --pp N (N > 1), or drop it")
    elif args.pp_schedule == "interleaved" and args.interleave < 2:
        raise UserError("--pp-schedule interleaved needs --interleave 2 or more (chunks per stage); 1 is 1f1b")
    if args.sequence_parallel and degrees["tp"] == 1:
        raise UserError(
            "--sequence-parallel splits the tensor-parallel group's sequence; add --tp N (N > 1), or drop it"
        )
    if args.zero and degrees["dp"] == 1 and degrees["cp"] == 1:
        raise UserError(
            f"--zero {args.zero} shards the state over the data-parallel replicas (and the context shards); with "
            "--dp 1 and no --cp there are none to shard it over; add --dp N (N > 1), or drop --zero"
        )
    if args.attention_kernel != "fa2" and not args.flash_attention:
        raise UserError(f"--attention-kernel {args.attention_kernel} is a fused kernel; drop --no-flash-attention")


def _optimizer(text: str) -> str:
    """An optimizer's name as the estimator knows it: AdamW keeps Adam's master weights and two moments."""
    name = {"adamw": "adam"}.get(text.strip().lower(), text.strip().lower())
    if name not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an optimizer; valid: {', '.join(OPTIMIZERS)}, adamw")
    return name


_optimizer.kind = "optimizer"  # type: ignore[attr-defined]


def train_config(args: argparse.Namespace, chip) -> TrainConfig:
    """The job the flags describe as the estimator prices it: read into its Plan (``from_plan.job_plan``, what
    ``--save-plan`` writes), and the estimator's config made from that Plan in the one place every Plan becomes one
    (:func:`lab.predict.training.from_plan.train_config`)."""
    from lab.predict.training.from_plan import job_plan
    from lab.predict.training.from_plan import train_config as priced

    return priced(job_plan(_flags_job(args, chip)), chip)


def _flags_job(args: argparse.Namespace, chip) -> TrainConfig:
    """The flags read into the estimator's terms, each checked: the degrees, the batch, the stack's options."""
    model = model_of(args)
    layout = uneven_stages(_layout(args), model.layers)
    seq = args.seq_len or model.max_seq_len
    replicas = layout.dp * layout.fsdp
    if args.global_batch is not None and args.batch_tokens is not None:
        raise UserError("give either --global-batch (sequences) or --batch-tokens, not both")
    if args.global_batch is not None:
        batch = args.global_batch
    elif args.batch_tokens is not None:
        if args.batch_tokens % seq:
            raise UserError(
                f"--batch-tokens {args.batch_tokens} is not a multiple of --seq-len {seq}; "
                f"try {max(seq, args.batch_tokens // seq * seq)}"
            )
        batch = args.batch_tokens // seq
    else:  # about 4M tokens, rounded to whole microbatches on every replica
        unit = replicas * args.microbatch
        batch = max(1, round(4 * 1024 * 1024 / seq / unit)) * unit
    if args.attention_kernel != "fa2" and chip.kind != "gpu":
        raise UserError(f"--attention-kernel {args.attention_kernel} is a GPU kernel; {chip.name} is a {chip.kind}")
    return TrainConfig(
        model=model,
        chip=chip,
        layout=layout,
        seq_len=seq,
        global_batch=batch,
        microbatch=args.microbatch,
        remat=args.remat,
        checkpoints_per_layer=args.checkpoints_per_layer,
        dtype=args.dtype,
        optimizer=args.optimizer,
        flash_attention=args.flash_attention,
        attention_kernel=args.attention_kernel,
        elementwise=args.elementwise,
        tp_comm_overlap=args.tp_comm_overlap,
        capacity_factor=args.capacity_factor,
        dp_overlap=not args.no_dp_overlap,
        dp_bucket_bytes=args.dp_bucket_mb * 2**20,
        grad_reduce=args.grad_reduce,
    )


def _job(args: argparse.Namespace):
    """``(estimate, plan, program estimate)``: from ``--plan FILE`` (the last two set), or from the flags."""
    if args.plan:
        from lab.predict.program.estimate import estimate_program

        plan, chip = plan_of(args, "train_step", "train estimate")
        program = estimate_program(plan, chip)
        return program.detail["train"], plan, program
    missing = [f for f, v in (("--hardware", args.hardware), ("--chips", args.chips)) if v is None]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)} (or --plan FILE)")
    return estimate(train_config(args, chip_of(args))), None, None


def _interval_text(iv) -> str:
    """``, likely 2.9-4.1 s (80%)``, or why there is no interval."""
    if iv is None:
        return " (no interval: no published run validates this chip kind)"
    lean = ""
    if iv.leaning_on and iv.s_constants > 0.5 * iv.s_class:
        lean = "; widened: leans on " + ", ".join(n for n, _ in iv.leaning_on)
    return f", {interval_text(iv, fmt_seconds)} (80%{lean})"


def _step_rows(est, iv=None) -> list[list[str]]:
    """The estimate's table: the job, the step and its parts, throughput, memory and the verdicts."""
    cfg, b, mem = est.config, est.breakdown, est.memory
    m, chip = cfg.model, cfg.chip
    comm = ", ".join(f"{k[5:-2]} {fmt_seconds(v)}" for k, v in b.items() if k.startswith("comm_") and v > 0)
    return [
        ["model / hardware", f"{m.name} ({fmt_count(m.params)} params) on {cfg.layout.chips} x {chip.name}"],
        [
            "layout",
            f"{cfg.layout.describe()}, remat {cfg.remat}, microbatch {cfg.microbatch} x {cfg.microbatches} per step",
        ],
        ["batch", f"{cfg.global_batch} x {cfg.seq_len} = {fmt_count(cfg.batch_tokens)} tokens"],
        ["step time", fmt_seconds(est.step_time_s) + _interval_text(iv)],
        ["  compute", fmt_seconds(b["compute_s"])],
        ["  exposed comm", fmt_seconds(b["exposed_comm_s"]) + f"  ({comm})"],
        ["  pipeline bubble", fmt_seconds(b["bubble_s"])],
        ["  optimizer", fmt_seconds(b["optimizer_s"])],
        *([["  offload (exposed)", fmt_seconds(b["offload_s"])]] if b.get("offload_s") else []),
        ["tokens/s", f"{fmt_count(est.tokens_per_s)} ({fmt_count(est.tokens_per_s / cfg.layout.chips)} per chip)"],
        ["MFU / HFU", f"{fmt_share(est.mfu)} / {fmt_share(est.hfu)}"],
        [
            "memory per chip",
            f"{mem.total / GiB:.1f} GiB of {mem.hbm_bytes / GiB:.1f} GiB: params "
            f"{mem.params / GiB:.1f}, grads {mem.grads / GiB:.1f}, optimizer {mem.optimizer / GiB:.1f},"
            f" activations {mem.activations / GiB:.1f}",
        ],
        ["fits", "yes" if mem.fits else f"NO: {est.overflow()} is the largest part"],
        ["min chips (whole batch)", str(est.min_chips)],
        ["bottleneck", est.bottleneck],
    ]


def _check_train_flags(args: argparse.Namespace) -> None:
    """What the flags' types cannot see: --mfu belongs to --tokens, and an MFU or a checkpoint count no run has."""
    if args.mfu is not None and args.tokens is None:
        raise UserError(f"--mfu {args.mfu:g} sets the days that --tokens takes; give --tokens too (e.g. --tokens 1e12)")
    if args.mfu is not None and args.mfu < MIN_MFU:
        raise UserError(
            f"--mfu {args.mfu:g} is below {MIN_MFU:g}: no training run is that idle (large runs reach 0.3-0.6); give "
            f"a fraction from {MIN_MFU:g} to 1, e.g. 0.4"
        )
    check_checkpoints(args.checkpoints_per_layer)


def cmd_train_estimate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    _check_train_flags(args)
    est, plan, program = _job(args)
    cfg = est.config
    m, chip = cfg.model, cfg.chip
    lay = cfg.layout
    if lay.pp > 1 and cfg.microbatches < lay.pp:  # runs, poorly: say by how much
        from lab.predict.axis_costs import bubble_fraction

        idle = bubble_fraction(lay.pp, cfg.microbatches, lay.v)
        warn(
            args,
            f"{cfg.microbatches} microbatches for {lay.pp} pipeline stages: each stage idles {100 * idle:.0f}% of "
            f"the step; give at least {lay.pp} (a smaller --microbatch or a larger batch)",
        )
    d = est.to_dict()
    iv = for_training(est)
    d["step_time_interval_s"] = iv.as_list() if iv else None
    d["interval"] = iv.to_dict() if iv else None
    if args.save_plan:
        d["plan_file"] = save_plan(cfg, args.save_plan)
    if program is not None:
        d |= {"ops": [o.to_dict() for o in program.ops], "plan": plan.to_dict()}
    total_flops = days = cost = None
    if args.tokens is not None and args.tokens < cfg.batch_tokens:  # less than one step: no training run
        raise UserError(
            f"--tokens {args.tokens:g} is less than one step of {cfg.global_batch} sequences x {cfg.seq_len} tokens "
            f"= {cfg.batch_tokens}; train on at least that many tokens, e.g. 1e12"
        )
    if args.tokens is not None:
        if args.seq_len is None:
            total_flops = 6.0 * m.active_params * args.tokens  # the book's convention
        else:
            total_flops = m.flops_per_token(args.seq_len) * args.tokens
        if args.mfu is not None:
            days = total_flops / (cfg.layout.chips * chip.flops(cfg.dtype) * args.mfu) / 86400
        else:
            days = args.tokens / est.tokens_per_s / 86400
        if chip.price_per_hour:
            cost = days * 24 * cfg.layout.chips * chip.price_per_hour
    d.update(total_flops=total_flops, days=days, cost_usd=cost, tokens=args.tokens, mfu_given=args.mfu)
    rows = _step_rows(est, iv)
    if total_flops is not None:
        rows += [
            ["total FLOPs", f"{total_flops:.3g}" + (" (6N)" if args.seq_len is None else "")],
            ["training time", f"{days:.1f} days" + (f" at MFU {args.mfu:g}" if args.mfu else " (predicted)")],
        ]
        if cost is not None:
            rows.append(["cost", f"${cost:,.0f} at ${chip.price_per_hour:.2f}/chip-hour"])
    text = render(["quantity", "value"], rows, title=f"plan {plan.name} ({args.plan})" if plan else None)
    if program is not None:
        text += "\n\n" + ops_table(program)
    return d, text


def save_plan(cfg: TrainConfig, path: str) -> str:
    """Write the job as an experiment file (a Plan) that ``train estimate --plan`` prices the same way."""
    from pathlib import Path

    from lab.predict.training.from_plan import job_plan

    plan = job_plan(cfg)
    lay = cfg.layout
    text = plan.to_toml(
        f"{cfg.model.name} on {lay.chips} x {cfg.chip.name}, {lay.describe()}: written by shardlab train estimate"
    )
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write the plan to {path!r}: {exc.strerror}") from None
    return path


def _register_train(sub, common, hw, with_chip) -> None:
    tp = sub.add_parser("train", help=help_of("train"))
    tsub = tp.add_subparsers(dest="train_command", required=True, parser_class=Parser, metavar="estimate|limits")
    te = tsub.add_parser(
        "estimate",
        parents=[common, hardware_parent(required=False), model_parent(positional=False)],
        help="step time, memory, MFU, days and cost of a training job",
    )
    te.add_argument(
        "--plan",
        type=in_path("--plan"),
        metavar="FILE",
        help="price exactly what this experiment file runs (its model, mesh, rules, sizes; its hardware unless "
        "--hardware), as named ops",
    )
    _job_flags(te)
    _layout_flags(te)
    _stack_flags(te)
    plan_options(te, *TRAIN_OPTIONS)
    command(te, cmd_train_estimate)
    from lab.cli.limits import register_limits

    register_limits(tsub, common, hw, with_chip)


def _job_flags(te) -> None:
    """train estimate's job: chips, the Plan written, tokens and MFU for days, batch and sequence."""
    te.add_argument("--chips", type=positive_int("--chips"), help="chips (required without --plan)")
    te.add_argument(
        "--save-plan",
        type=out_path("--save-plan"),
        metavar="FILE",
        help="also write this job as an experiment file (a Plan)",
    )
    add_overwrite(te)
    te.add_argument(
        "--tokens", type=positive_float("--tokens", "1e12"), help="training tokens, for total FLOPs, days and cost"
    )
    te.add_argument("--mfu", type=fraction("--mfu"), help="take days at this MFU instead of the predicted step time")
    bg = te.add_mutually_exclusive_group()
    bg.add_argument("--global-batch", type=positive_int("--global-batch"), metavar="SEQS")
    bg.add_argument("--batch-tokens", type=positive_int("--batch-tokens"), metavar="B", help=BATCH_TOKENS_HELP)
    te.add_argument("--seq-len", type=positive_int("--seq-len"), help="default: the model's context")
    te.add_argument("--microbatch", type=positive_int("--microbatch"), default=1)


def _layout_flags(te) -> None:
    """train estimate's parallel degrees and how each runs (ZeRO, data-parallel overlap, pipeline, experts)."""
    for k in ("dp", "fsdp", "tp", "pp", "cp"):
        te.add_argument(f"--{k}", type=positive_int(f"--{k}"))
    te.add_argument("--ep", type=positive_int("--ep"), default=1)
    te.add_argument("--zero", type=nonneg_int("--zero"), choices=(0, 1, 2, 3), default=0)
    te.add_argument(
        "--zero-shard",
        type=positive_int("--zero-shard"),
        metavar="N",
        help="ZeRO-1/2: shard the state over groups of N data-parallel ranks (a node's: DeepSpeed MiCS/hpZ, "
        "Megatron's distributed-optimizer instances) instead of all of them; weights gathered inside a group",
    )
    te.add_argument(
        "--no-dp-overlap",
        action="store_true",
        help="the data-parallel reduction (and ZeRO's weight gather) runs after the backward, exposed (DeepSpeed "
        "ZeRO-1/2's default, overlap_comm false); default: in buckets under the backward",
    )
    te.add_argument(
        "--dp-bucket-mb",
        type=positive_float("--dp-bucket-mb", "25"),
        default=25.0,
        metavar="MIB",
        help="the gradient reduction's bucket, MiB: its last one is exposed after the backward (default 25, PyTorch "
        "DDP's; Megatron 40M parameters, DeepSpeed 5e8 elements)",
    )
    te.add_argument("--sequence-parallel", action="store_true")
    te.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b")
    te.add_argument("--interleave", type=positive_int("--interleave"), default=1)
    te.add_argument(
        "--capacity-factor",
        type=positive_float("--capacity-factor", "1.25"),
        default=1.0,
        metavar="C",
        help="MoE: each expert computes C x its share of the routed tokens (padded slots), and the dispatch and "
        "combine move as much (default 1.0: dropless, balanced)",
    )
    te.add_argument(
        "--pp-split",
        type=positive_ints("--pp-split"),
        metavar="N,N,...",
        help="uneven pipeline stages: the layers each stage holds, first to last, adding up to the model's layers "
        "(e.g. 7,8,8,7 for 30 layers on --pp 4; the last stage also computes the loss)",
    )
    te.add_argument(
        "--pp-embedding-slots",
        action="store_true",
        help="the embedding and the loss each take a layer's slot in the pipeline split (Megatron-Core's "
        "account_for_embedding/loss_in_pipeline_split): layers + 2 must divide by pp x interleave",
    )


def _stack_flags(te) -> None:
    """train estimate's recomputation, dtypes and how the stack runs its kernels."""
    te.add_argument(
        "--remat",
        choices=REMAT_ALL,
        default="selective",
        metavar="POLICY",
        help="activation recomputation: none, selective, full, or a named policy (MaxText's names: minimal, "
        "save_dot_except_mlpwi, save_qkv_proj, minimal_offloaded, ...; see docs) (default selective)",
    )
    te.add_argument(
        "--checkpoints-per-layer",
        type=positive_float("--checkpoints-per-layer", "2 or 4.5"),
        metavar="K",
        help="the book's k saved [B, D] tensors per layer (sets activation memory)",
    )
    te.add_argument("--dtype", choices=("bf16", "fp16", "fp8"), default="bf16")
    te.add_argument(
        "--optimizer",
        type=_optimizer,
        default="adam",
        help=f"one of {', '.join(OPTIMIZERS)} (adamw is adam: the same two moments)",
    )
    te.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True)
    te.add_argument(
        "--attention-kernel",
        choices=("fa2", "fa3"),
        default="fa2",
        help="the fused attention kernel on GPUs, at its measured rate: fa2 (PyTorch SDPA and most stacks; "
        "default) or fa3 (FlashAttention-3 / cuDNN, as Megatron/NeMo's Transformer Engine runs it)",
    )
    te.add_argument(
        "--elementwise",
        choices=ELEMENTWISE,
        default="fused",
        help="how the stack runs norms, rotary embedding and the activation: fused (one kernel each, as "
        "Megatron/Transformer Engine, XLA and torch.compile do; default) or eager (PyTorch eager ops, fp32 "
        "intermediates, as the reference LLaMA code writes them)",
    )
    te.add_argument(
        "--grad-reduce",
        choices=GRAD_REDUCE,
        help="the dtype gradients are reduced in (default: the weights', bf16 under mixed precision, the book's "
        "convention): fp32 is Megatron-LM's default for bf16 training (unless --grad-reduce-in-bf16), torchtitan's "
        "FSDP2 default and nanotron's (twice the data-parallel bytes)",
    )
    te.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="with --sequence-parallel: TP's AllGathers and ReduceScatters in chunks under the GEMMs, as Transformer "
        "Engine's userbuffers run them (Megatron-Core --tp-comm-overlap, NeMo's MLPerf recipes) (default: exposed)",
    )


def register(sub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser, with_chip) -> None:
    """Add ``train`` (estimate, limits) to the ``shardlab`` parser."""
    _register_train(sub, common, hw, with_chip)


__all__ = ["register"]
