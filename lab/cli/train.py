"""Command line for the model catalog and the training estimator (registered by :mod:`lab.cli.main`)."""

from __future__ import annotations

import argparse
import dataclasses
import math

from lab.cli.args import (
    MAX_SEQ_LEN,
    Parser,
    add_calls,
    add_target,
    chart_path,
    check_model_path,
    chip_of,
    command,
    dtype_arg,
    fraction,
    hardware_parent,
    in_path,
    model_of,
    model_parent,
    nonneg_int,
    ops_table,
    out_path,
    plan_of,
    plan_options,
    positive_float,
    positive_int,
    positive_ints,
    scale_arg,
    warn,
    write_chart,
)
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.models import CATALOG, resolve_model
from lab.core.table import render
from lab.core.units import NUMPY_NAME, canonical_dtype, fmt_bytes, fmt_count, fmt_seconds, numpy_name
from lab.predict.intervals import for_training
from lab.predict.intervals import text as interval_text
from lab.predict.remat import ALL as REMAT_ALL
from lab.predict.train_config import ELEMENTWISE, MAX_CHECKPOINTS_PER_LAYER
from lab.predict.training import OPTIMIZERS, SCHEDULES, Layout, TrainConfig, estimate

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
)
MIN_MFU = 1e-3  # an MFU below 0.1% is a typo: large training runs reach 0.3-0.6 (the calibration set's Megatron runs)
# A whole number of sequences: 4Mi = 4,194,304 = 512 x 8192 divides by every power-of-two --seq-len (4M does not)
BATCH_TOKENS_HELP = "tokens per optimizer step, all sequences together: a multiple of --seq-len (e.g. 4Mi or 4194304)"


def cmd_model_list(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    rows = [
        [
            m.name,
            fmt_count(m.params),
            fmt_count(m.active_params),
            m.layers,
            m.d_model,
            m.d_ff,
            m.heads,
            m.kv_heads,
            m.vocab,
            m.source,
        ]
        for m in CATALOG
    ]
    text = render(["name", "params", "active", "L", "D", "F", "N", "K", "V", "source"], rows)
    return {"models": [m.to_dict() for m in CATALOG]}, text


def cmd_model_show(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    m = model_of(args)
    kv = canonical_dtype(args.kv_dtype)
    d = m.to_dict(seq_len=args.seq_len, kv_dtype=kv)
    rows = [
        ["params", f"{fmt_count(m.params)} ({m.params:,})"],
        [
            "active params",
            f"{fmt_count(m.active_params)}"
            + (f" ({m.experts_per_token} of {m.experts} experts)" if m.is_moe else "")
            + (f" + {m.shared_experts} shared" if m.shared_experts else "")
            + (f"; {m.dense_layers} dense layers (d_ff {m.dense_ff})" if m.dense_layers else ""),
        ],
        ["layers / d_model / d_ff", f"{m.layers} / {m.d_model} / {m.d_ff}" + (" (gated)" if m.gated_mlp else "")],
        ["heads / kv_heads / head_dim", f"{m.heads} / {m.kv_heads} / {m.head_dim}"],
        ["vocab", f"{m.vocab}" + (" (tied)" if m.tied_embeddings else "")],
        [f"KV cache per token ({kv})", fmt_bytes(m.kv_bytes_per_token(kv))],
        [
            "training FLOPs per token",
            f"{fmt_count(d['flops_per_token'])} ({d['flops_convention']}"
            + (f", seq {args.seq_len})" if args.seq_len else ")"),
        ],
        ["source", m.source],
    ]
    return d, render(["quantity", "value"], rows, title=m.name)


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
    if args.zero and degrees["dp"] == 1:
        raise UserError(
            f"--zero {args.zero} shards the state over the data-parallel replicas; with --dp 1 there are none to "
            "shard it over; add --dp N (N > 1), or drop --zero"
        )
    if args.attention_kernel != "fa2" and not args.flash_attention:
        raise UserError(f"--attention-kernel {args.attention_kernel} is a fused kernel; drop --no-flash-attention")


def train_config(args: argparse.Namespace, chip) -> TrainConfig:
    model = model_of(args)
    layout = _layout(args)
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
    )


def _job(args: argparse.Namespace):
    """``(estimate, plan, program estimate)``: from ``--plan FILE`` (the last two set), or from the flags."""
    if args.plan:
        from lab.predict.program import estimate_program

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
        ["MFU / HFU", f"{100 * est.mfu:.1f}% / {100 * est.hfu:.1f}%"],
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
    _check_checkpoints(args.checkpoints_per_layer)


def _check_checkpoints(k: float | None) -> None:
    if k is not None and k > MAX_CHECKPOINTS_PER_LAYER:
        raise UserError(
            f"--checkpoints-per-layer {k:g}: a layer saves a few to a few hundred [tokens, d_model] tensors, never "
            f"that many; give at most {MAX_CHECKPOINTS_PER_LAYER}, e.g. 2 or 4.5"
        )


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

    from lab.core.plan import Options, plan_from_degrees

    lay = cfg.layout
    if cfg.remat not in ("none", "selective", "full"):
        raise UserError(f"--save-plan cannot record --remat {cfg.remat} (a Plan runs none, selective or full)")
    if cfg.capacity_factor != 1.0:
        raise UserError("--save-plan cannot record --capacity-factor yet (a Plan has no MoE routing options); drop one")
    unrecorded = [  # GPU kernel and pipeline-split choices a Plan does not carry: its estimate would differ
        flag
        for flag, given in (
            (f"--attention-kernel {cfg.attention_kernel}", cfg.attention_kernel != "fa2"),
            (f"--elementwise {cfg.elementwise}", cfg.elementwise != "fused"),
            ("--tp-comm-overlap", cfg.tp_comm_overlap),
            ("--pp-embedding-slots", lay.pp_embedding_slots),
            (f"--zero-shard {lay.zero_shard}", bool(lay.zero_shard)),
            ("--no-dp-overlap", not cfg.dp_overlap),
            (f"--dp-bucket-mb {cfg.dp_bucket_bytes / 2**20:g}", cfg.dp_bucket_bytes != 25 * 2**20),
        )
        if given
    ]
    if unrecorded:
        raise UserError(f"--save-plan cannot record {', '.join(unrecorded)} (a Plan has no such option); drop one")
    options = Options(
        microbatch=cfg.microbatch,
        zero=lay.zero,
        pp_schedule=lay.pp_schedule,
        interleave=lay.interleave,
        stage_split=lay.stage_split,
        checkpoints_per_layer=cfg.checkpoints_per_layer,
        flash_attention=cfg.flash_attention,
        fused_projections=cfg.fused_projections,
        causal=cfg.causal,
        cast_first=cfg.cast_first,
        regather_norms=cfg.remat_regathers_norms,
        jax_remat=cfg.jax_remat,
        spmd_pipeline=cfg.spmd_pipeline,
        spmd_context=cfg.spmd_context,
    )
    plan = plan_from_degrees(
        cfg.model,
        hardware=cfg.chip.name,
        batch=cfg.global_batch,
        seq_len=cfg.seq_len,
        **{k: getattr(lay, k) for k in ("dp", "fsdp", "tp", "pp", "cp", "ep", "sequence_parallel")},
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        remat=cfg.remat,
        optimizer=cfg.optimizer,
        options=options,
    )
    text = plan.to_toml(
        f"{cfg.model.name} on {lay.chips} x {cfg.chip.name}, {lay.describe()}: written by train estimate"
    )
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write the plan to {path!r}: {exc.strerror}") from None
    return path


def cmd_train_limits(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    d_ff, model = args.d_ff, None
    if args.model is not None:  # read even when --d-ff overrides its d_ff: a bad name is an error, never ignored
        check_model_path(args.model)
        model = resolve_model(args.model)
        d_ff = d_ff or model.d_ff
    if args.checkpoints_per_layer is not None and (model is None or args.batch_tokens is None):
        raise UserError("--checkpoints-per-layer needs --model and --batch-tokens (the job whose memory it counts)")
    _check_checkpoints(args.checkpoints_per_layer)
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
        from lab.predict.planner import MAX_CHIPS

        if d_ff is None or args.batch_tokens is None:
            raise UserError(
                f"--chips {args.chips} sets the best FSDP degree, which also needs --batch-tokens and --d-ff (or "
                "--model); give them, or drop --chips"
            )
        if args.chips > MAX_CHIPS:
            raise UserError(f"--chips {args.chips} is more chips than any machine has; give at most {MAX_CHIPS}")
    from lab.predict.limits import limits

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


def cmd_plan(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    from lab.predict.planner import plan

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
        if t.chips != args.chips:
            raise UserError(f"--target {t.name} has {t.chips} chips; give --chips {t.chips}")
        require_libtpu()
        return
    if args.chips > MAX_EMULATED:
        raise UserError(f"--validate runs on this host's devices; --chips {args.chips} is more than it can emulate")
    ensure_devices(args.chips, exact=True)


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
    from lab.cli.infer import cmd_study_memtech

    return cmd_study_memtech(args)


def _unfit_row(key: str, row) -> bool:
    """A memory-tech row where the model does not fit has no step time (``inf``) and no speed-up."""
    return row.get("fits") is False and key in ("decode_step_s", "speedup_vs_first", "efficiency")


def cmd_validate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.hardware_file:  # read (and checked) by command(); the published runs are priced on the catalog's chips
        raise UserError(
            f"validate prices the published runs on the catalog's chips (a100-80gb, h100, ...) and reads no "
            f"--hardware-file; drop --hardware-file {args.hardware_file}"
        )
    from lab.studies.intervals_fit import with_intervals
    from lab.studies.validate import run_validation
    from lab.studies.validate_public import run_public_validation

    if args.write_intervals:
        from lab.predict.intervals import TABLE
        from lab.studies.intervals_fit import write

        data = write()
        rows = [
            [c["name"], c["runs"], c["sources"], f"{c['mu']:+.3f}", f"{c['s_between']:.3f}", f"{c['s_within']:.3f}"]
            for c in data["classes"]
        ]
        return data, render(
            ["class", "runs", "sources", "mu", "s between", "s within"],
            rows,
            title=f"wrote {TABLE}: the development set's residuals, log(measured / predicted)",
        )
    if args.case is not None:
        return _validate_case(args.case)
    group = "development" if args.group == "public" else args.group  # 'public': the development set's old name
    data: dict[str, Any] = {}
    texts = []
    if group in ("calibration", "all"):
        v = run_validation()
        data["calibration"] = v.to_dict()
        texts.append(v.table())
    heads = []
    for split in ("development", "test"):
        if group in (split, "all"):
            pv = with_intervals(run_public_validation(split))
            data[split] = pv.to_dict()
            texts.append(pv.table())
            heads.append(pv.headline())
    if group == "all":
        texts.append("\n".join(heads))
    if args.sensitivity:
        from lab.studies.sensitivity import run_sensitivity

        splits = tuple(s for s in ("development", "test") if group in (s, "all"))
        if not splits:
            raise UserError(
                "--sensitivity prices the development set and the test split; give --group development, test or all"
            )
        sens = run_sensitivity(splits)
        texts.append(sens.table())
        if group != "all":
            data = {group: data[group]}
        data["sensitivity"] = sens.to_dict()
        return data, "\n\n".join(texts)
    return (data if group == "all" else next(iter(data.values()))), "\n\n".join(texts)


def _validate_case(case: str) -> tuple[dict[str, Any], str]:
    """One published run: its prediction, error and 80% interval, and the constants that move it most."""
    from lab.predict.intervals import interval
    from lab.studies.intervals_fit import run_shifts
    from lab.studies.validate_public import PublicValidation, predict, split_runs

    runs = {r.case_id: r for s in ("development", "test") for r in split_runs(s)}
    run = runs.get(case.strip().upper())
    if run is None:
        raise UserError(
            f"--case {case!r} is no published run; valid: {', '.join(list(runs)[:6])}, ... (validate lists them all)"
        )
    row = predict(run)
    if row.error is None:
        why = row.detail.removeprefix("not expressible: ").removeprefix("refused: ")
        raise UserError(
            f"--case {run.case_id} is not expressible ({why}): it has no prediction, so no interval; "
            "pick an answered run"
        )
    alone = PublicValidation((row,), run.split)
    iv = interval(1.0, run.group, run_shifts(run.split, alone).get(run.case_id))
    inside = iv.lo <= 1 / (1 + row.error) <= iv.hi
    lean = ", ".join(f"{n} x{f:.3f}" for n, f in iv.leaning_on) or "none"
    rows = [
        ["run", f"{run.case_id} ({run.split}): {run.group}, {run.model} on {run.chips} {run.chip}"],
        ["source", run.source],
        ["measured", f"{run.measured:.4g} {run.unit}" + (f"  ({run.quote})" if run.quote else "")],
        ["predicted", f"{row.predicted:.4g} {run.unit}: {row.detail}"],
        ["error (as a time)", f"{100 * row.error:+.1f}%"],
        [
            "80% interval (time)",
            f"{100 * (iv.lo - 1):+.0f}% to {100 * (iv.hi - 1):+.0f}% of the prediction: measured "
            + ("inside" if inside else "OUTSIDE"),
        ],
        ["leans on", lean],
    ]
    data = row.to_dict() | {"interval_ratio": iv.as_list(), "inside": inside, "interval": iv.to_dict()}
    return data, render(["quantity", "value"], rows)


def _register_model(sub, common, hw, with_chip) -> None:
    mp = sub.add_parser("model", help=help_of("model"))
    msub = mp.add_subparsers(dest="model_command", required=True, parser_class=Parser, metavar="list|show")
    ml = msub.add_parser("list", parents=[common], help="every catalog model")
    command(ml, cmd_model_list)
    ms = msub.add_parser(
        "show",
        parents=[common, model_parent(positional=True)],
        help="params, FLOPs per token, KV bytes of a catalog or custom model",
    )
    ms.add_argument("--kv-dtype", type=dtype_arg, default="bf16")
    ms.add_argument("--seq-len", type=positive_int("--seq-len"), help="FLOPs per token at this context")
    command(ms, cmd_model_show)


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
    te.add_argument("--chips", type=positive_int("--chips"), help="chips (required without --plan)")
    te.add_argument(
        "--save-plan",
        type=out_path("--save-plan"),
        metavar="FILE",
        help="also write this job as an experiment file (a Plan)",
    )
    te.add_argument(
        "--tokens", type=positive_float("--tokens", "1e12"), help="training tokens, for total FLOPs, days and cost"
    )
    te.add_argument("--mfu", type=fraction("--mfu"), help="take days at this MFU instead of the predicted step time")
    bg = te.add_mutually_exclusive_group()
    bg.add_argument("--global-batch", type=positive_int("--global-batch"), metavar="SEQS")
    bg.add_argument("--batch-tokens", type=positive_int("--batch-tokens"), metavar="B", help=BATCH_TOKENS_HELP)
    te.add_argument("--seq-len", type=positive_int("--seq-len"), help="default: the model's context")
    te.add_argument("--microbatch", type=positive_int("--microbatch"), default=1)
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
    te.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    te.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
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
        "--tp-comm-overlap",
        action="store_true",
        help="with --sequence-parallel: TP's AllGathers and ReduceScatters in chunks under the GEMMs, as Transformer "
        "Engine's userbuffers run them (Megatron-Core --tp-comm-overlap, NeMo's MLPerf recipes) (default: exposed)",
    )
    plan_options(te, *TRAIN_OPTIONS)
    command(te, cmd_train_estimate)

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
    add_target(pl, "with --validate: ")
    pl.add_argument("--out", type=in_path("--out"), help="with --validate: where the runs go (default runs/plan)")
    add_calls(
        pl,
        "with --validate on this host: untraced calls of each layout's step before the profiled ones (default 3)",
        "with --validate on this host: profiled calls of each layout's step (default 5); more for a steadier "
        "measured ranking",
    )
    command(pl, with_chip(cmd_plan))


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
    command(sm, _study_memtech, allowed=_unfit_row)


def _register_validate(sub, common, hw, with_chip) -> None:
    v = sub.add_parser("validate", parents=[common], help=help_of("validate"))
    v.add_argument(
        "--group",
        choices=("calibration", "development", "test", "all", "public"),
        default="all",
        help="calibration: the published Megatron runs the efficiency model was chosen on; development: public "
        "measured runs looked at while the model changed (in-sample; 'public' is its old name); test: runs committed "
        "before the estimators saw them and never tuned on, the honest figure; all: the three (default)",
    )
    v.add_argument("--case", metavar="ID", help="one run (PT01, T201, ...): its prediction, error and 80%% interval")
    v.add_argument(
        "--write-intervals",
        action="store_true",
        help="derive the residual table behind every estimate's 80%% interval from the development set and write it "
        "(lab/predict/data/intervals.json); the test split is never read",
    )
    v.add_argument(
        "--sensitivity",
        action="store_true",
        help="also price the development set and test split with each B or C graded constant (lab/predict/"
        "constants.py) swapped for its stated alternative: the change of each class's mean |err|",
    )
    command(v, cmd_validate)


_REGISTER = {
    "model": _register_model,
    "train": _register_train,
    "plan": _register_plan,
    "study": _register_study,
    "validate": _register_validate,
}


def register(
    sub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser, with_chip, only: str | None = None
) -> None:
    """Add ``model``, ``train``, ``plan``, ``study`` and ``validate`` to the ``shardlab`` parser; with ``only``, build
    that command's parser alone and list the others by name and help (start-up: a command builds its own flags)."""
    for name, build in _REGISTER.items():
        if only in (None, name):
            build(sub, common, hw, with_chip)
        else:
            sub.add_parser(name, help=help_of(name))


__all__ = ["register"]
