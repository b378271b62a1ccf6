"""Command line of the inference estimator (registered by :mod:`lab.cli.main`)."""

from __future__ import annotations

import argparse
import dataclasses

from lab.cli.args import (
    MAX_SEQ_LEN,
    Parser,
    add_overwrite,
    chart_path,
    chip_of,
    command,
    dtype_arg,
    fraction,
    hardware_parent,
    in_path,
    positive_int,
    positive_ints,
    scale_arg,
    warn,
    write_chart,
)
from lab.cli.commands import help_of
from lab.cli.model_args import model_of, model_parent, ops_table, plan_of, plan_options
from lab.cli.stack_args import add_attention_dp, add_ideal, add_step_overhead, add_tp_allreduce
from lab.core.errors import UserError
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_count, fmt_seconds
from lab.predict.efficiency import FP8_DECODE_TIME_VS_BF16, FP8_SCALINGS, eager_host_time
from lab.predict.inference.allreduce import priced_allreduce
from lab.predict.inference.estimate import MOE_WEIGHTS, WEIGHT_DTYPES, InferConfig, estimate_inference
from lab.predict.inference.from_plan import fill_degrees, serving_plan
from lab.predict.inference.from_plan import infer_config as plan_infer_config
from lab.predict.intervals import for_inference
from lab.predict.intervals import text as interval_text

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

GiB = 2**30


def _storage_dtype(text: str) -> str:
    from lab.core.units import canonical_dtype

    try:
        dt = canonical_dtype(text)
    except UserError:
        dt = None
    if dt not in WEIGHT_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a storage dtype; valid: {', '.join(WEIGHT_DTYPES)}")
    return dt


_storage_dtype.kind = "dtype"


def _warn_context(args: argparse.Namespace, model) -> None:
    if args.context > model.max_seq_len:
        warn(
            args,
            f"--context {args.context} exceeds {model.name}'s trained context of {model.max_seq_len}; "
            "estimating anyway",
        )


def infer_config(args: argparse.Namespace, chip) -> InferConfig:
    missing = [
        f for f, v in (("--chips", args.chips), ("--batch", args.batch), ("--context", args.context)) if v is None
    ]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)}")
    model = model_of(args)
    tp, dp, ep = fill_degrees(args.chips, args.tp, args.dp, args.ep, ep_flag=True)
    if args.prefill_len is not None and args.prefill_len > args.context:
        raise UserError(
            f"--prefill-len {args.prefill_len} is longer than --context {args.context}: the KV cache holds the "
            f"prompt; give --prefill-len at most {args.context}, or --context {args.prefill_len}"
        )
    if args.mfu is not None and args.prefill_len is None:
        raise UserError(f"--mfu {args.mfu:g} prices the prefill at that MFU; give --prefill-len too (e.g. 2048)")
    if args.generate is not None and args.generate > MAX_SEQ_LEN:
        raise UserError(
            f"--generate {args.generate} tokens is longer than any model's context; give at most {MAX_SEQ_LEN:,} "
            "(e.g. 512)"
        )
    scaling = getattr(args, "fp8_scaling", None)
    if scaling is not None and not (not args.ideal and args.weights == "fp8" and args.compute == "fp8"):
        raise UserError(
            f"--fp8-scaling {scaling} prices fp8 weights multiplying fp8 activations under the efficiency model; give "
            "it with --weights fp8 --compute fp8 and without --ideal, or drop it"
        )
    _warn_context(args, model)
    plan = serving_plan(
        model, batch=args.batch, tp=tp, dp=dp, ep=ep, prefill_len=args.prefill_len, generate=args.generate
    )
    return plan_infer_config(
        plan,
        chip,
        context=args.context,
        weights=args.weights,
        kv=args.kv,
        compute=args.compute,
        mfu=args.mfu,
        achievable=not args.ideal,
        fp8_scaling=scaling or "dynamic",
        moe_weights=getattr(args, "moe_weights", "all"),  # infer estimate's flags; the other commands price the default
        step_overhead_s=getattr(args, "step_overhead", 0.0),
        eager=getattr(args, "eager", False),
        tp_allreduce=getattr(args, "tp_allreduce", None),
        attention_dp=getattr(args, "attention_dp", False),
    )


def _collectives_note(e) -> str:
    """``  (latency-bound; the stack's own all-reduce)``: what bounds the step's collectives and who runs them."""
    bits = ["latency-bound"] if e.latency_bound_collectives else []
    if e.config.tp > 1 and e.config.achievable and priced_allreduce(e.config) == "custom":
        bits.append("the stack's own all-reduce")
    return f"  ({'; '.join(bits)})" if bits else ""


def _experts_note(cfg) -> str:
    """What a mixture of experts' decode step is assumed to read: every expert (the default) or the routed ones."""
    from lab.predict.inference.estimate import experts_read

    n = cfg.model.experts
    if cfg.moe_weights == "all":
        return f"all {n} of each MoE layer every step (--moe-weights all, as common JAX code reads; routed: vLLM's)"
    return f"{n * experts_read(cfg, cfg.replica_batch):.3g} of {n} of each MoE layer on average (--moe-weights routed)"


def _likely(iv, cfg) -> str:
    """``; likely 5.9-7.9 ms`` (80%: the achievable prediction's interval, which an ideal bound sits below)."""
    if iv is None:
        return ""
    basis = "" if cfg.achievable else ", achievable"
    return f"; {interval_text(iv, fmt_seconds)} (80%{basis})"


def _no_continuous(args: argparse.Namespace) -> None:
    if args.continuous:
        raise UserError(
            "--continuous is gone: continuous batching is priced by its scheduler, request by request; try "
            "`shardlab infer serve --concurrency N --prompt-len P --output-len G` (the TPOT under that load)"
        )


def _infer_job(args: argparse.Namespace):
    """``(estimate, chip, plan, program)``: from ``--plan FILE`` (the last two set), or from the flags."""
    if args.plan:
        from lab.predict.program.estimate import estimate_program

        plan, chip = plan_of(args, "decode", "infer estimate")
        program = estimate_program(plan, chip)
        return program.detail["infer"], chip, plan, program
    needed = (
        ("--hardware", args.hardware),
        ("--chips", args.chips),
        ("--batch", args.batch),
        ("--context", args.context),
    )
    missing = [f for f, v in needed if v is None]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)} (or --plan FILE)")
    chip = chip_of(args)
    return estimate_inference(infer_config(args, chip)), chip, None, None


def cmd_infer_estimate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    _no_continuous(args)
    e, chip, plan, program = _infer_job(args)
    cfg = e.config
    m = cfg.model
    decode_iv = for_inference(cfg, "decode_step_s")
    prefill_iv = for_inference(cfg, "prefill_s") if e.prefill_s is not None else None
    rows = [
        [
            "model / hardware",
            f"{m.name} on {cfg.chips} x {chip.name} (tp={cfg.tp} dp={cfg.dp} ep={cfg.ep}"
            + (", attention data-parallel" if cfg.attention_dp else "")
            + "), "
            f"{'ideal roofline' if not cfg.achievable else 'achievable efficiency'}",
        ],
        [
            "batch / context",
            f"{cfg.batch} sequences x {cfg.context} tokens; weights {cfg.weights}, KV {cfg.kv}, compute {cfg.compute}",
        ],
        ["weights", f"{fmt_bytes(e.param_bytes)} ({fmt_bytes(e.param_bytes_per_chip)} per chip)"],
        ["KV cache", f"{fmt_bytes(e.kv_bytes)} ({fmt_bytes(e.kv_bytes_per_chip)} per chip)"],
        [
            "fits",
            ("yes" if e.fits else "NO") + f": {e.total_bytes_per_chip / GiB:.1f} of "
            f"{chip.hbm_bytes / GiB:.1f} GiB per chip; max batch {e.max_batch}, min chips {e.min_chips}",
        ],
        ["decode step", f"{fmt_seconds(e.decode_step_s)} ({e.bound}-bound){_likely(decode_iv, cfg)}"],
        ["  KV reads", fmt_seconds(e.kv_s)],
        ["  weight reads / FLOPs", f"{fmt_seconds(e.weights_s)} / {fmt_seconds(e.compute_s)}"],
        *([["  experts read", _experts_note(cfg)]] if m.is_moe else []),
        ["  collectives", fmt_seconds(e.comm_s) + _collectives_note(e)],
        *([["  host (eager)", f"{fmt_seconds(e.host_s)}  (its ops issued from Python)"]] if cfg.eager else []),
        ["throughput", f"{fmt_count(e.tokens_per_s)} tokens/s ({e.tokens_per_s_per_chip:,.0f} per chip)"],
        ["TP limit (memory-bound)", f"{e.tp_max_degree:.0f}-way at this batch (F / (B W_hbm / W_ici))"],
    ]
    if e.prefill_s is not None:
        rows.append(
            [
                "prefill / TTFT",
                f"{fmt_seconds(e.prefill_s)} for {cfg.prefill_len} tokens x {cfg.batch}"
                + (f" at MFU {cfg.mfu:g}" if cfg.mfu else "")
                + _likely(prefill_iv, cfg),
            ]
        )
    if e.generate_s is not None:
        rows.append(["generate", f"{fmt_seconds(e.generate_s)} for {cfg.generate} tokens"])
    if e.cost_per_million_tokens_usd is not None:
        rows.append(["cost", f"${e.cost_per_million_tokens_usd:.3f} per million tokens"])
    d = e.to_dict()
    d["decode_step_interval_s"] = decode_iv.as_list() if decode_iv else None
    d["prefill_interval_s"] = prefill_iv.as_list() if prefill_iv else None
    d["intervals"] = {
        "basis": "achievable",
        "decode": decode_iv.to_dict() if decode_iv else None,
        "prefill": prefill_iv.to_dict() if prefill_iv else None,
    }
    if program is None:
        return d, render(["quantity", "value"], rows)
    rows.append(["the Plan's program", f"{fmt_seconds(program.step_time_s)}: {program.notes[0]}"])
    d |= {"program_s": program.step_time_s, "ops": [o.to_dict() for o in program.ops], "plan": plan.to_dict()}
    return d, render(["quantity", "value"], rows, title=f"plan {plan.name} ({args.plan})") + "\n\n" + ops_table(program)


def cmd_infer_sweep(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.studies.serving import sweep

    model = model_of(args)
    _warn_context(args, model)
    result = sweep(
        model,
        args.hardware,
        context=args.context,
        weights=args.weights,
        kv=args.kv,
        chips=args.chips,
        batches=args.batches,
        achievable=not args.ideal,
        hardware_file=args.hardware_file,
        scale=args.scale,
    )
    _check_sweep(args, model, result)
    png = write_chart(args.png, f"runs/infer/sweep_{model.name}_{result.hardware}.png", result.plot)
    return result.to_dict() | {"png": png}, result.table() + f"\n\nchart: {png}"


def _check_sweep(args: argparse.Namespace, model, result) -> None:
    """A sweep that priced nothing, or a batch it could price on no topology, is a mistake said aloud (as `shardlab
    plan` refuses a chip count no layout suits), not an empty table with exit 0."""
    from lab.predict.inference.estimate import max_replica_batch

    if not result.points:
        chip = chip_of(args)
        fitting = [
            d
            for d in range(1, model.heads + 1)
            if model.heads % d == 0 and max_replica_batch(model, chip, d, 1, args.context, args.weights, args.kv) >= 1
        ]
        hint = (
            f"try --chips {','.join(map(str, fitting[:4]))} (tensor-parallel degrees that divide the {model.heads} "
            "heads and hold the model)"
            if fitting
            else "no degree that divides its heads holds it: try a smaller --weights, --kv or --context"
        )
        reasons = "; ".join(result.skipped[:3]) + ("; ..." if len(result.skipped) > 3 else "")
        raise UserError(f"no topology of {result.hardware} serves {model.name} ({reasons}); {hint}")
    largest = max(p.batch for p in result.points)
    too_big = sorted(b for b in args.batches or () if b > largest)
    if too_big:
        raise UserError(
            f"--batches {too_big[-1]}: at most {largest} sequences of {result.context} tokens fit on any topology "
            f"swept; give batches from 1 to {largest}"
        )


def cmd_infer_topology(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.studies.serving import topology, topology_table

    model = model_of(args)
    _warn_context(args, model)
    rows = topology(model, args.hardware, context=args.context, hardware_file=args.hardware_file, scale=args.scale)
    data = {"model": model.name, "hardware": args.hardware, "context": args.context, "rows": [r.__dict__ for r in rows]}
    return data, topology_table(rows, model.name, args.hardware, args.context)


def cmd_infer_disaggregate(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    """Prefill and decode servers of the same topology: how many prefill servers per decode server."""
    from lab.studies.serving import disaggregate

    cfg = infer_config(args, chip)
    if cfg.prefill_len is None or cfg.generate is None:
        raise UserError("infer disaggregate needs --prefill-len P and --generate G (median prompt and output lengths)")
    single = dataclasses.replace(cfg, batch=cfg.dp, context=cfg.prefill_len)  # one sequence a replica
    prefill_s = estimate_inference(single).prefill_s / cfg.dp
    decode = estimate_inference(cfg)
    ratio = disaggregate(prefill_s, decode.decode_step_s, cfg.batch, cfg.generate)
    data = {
        "prefill_s": prefill_s,
        "decode_step_s": decode.decode_step_s,
        "batch": cfg.batch,
        "prefill_len": cfg.prefill_len,
        "generate": cfg.generate,
        "prefill_servers_per_decode_server": ratio,
        "chips_per_server": cfg.chips,
    }
    rows = [
        ["prefill of one sequence", fmt_seconds(prefill_s) + (f" at MFU {cfg.mfu:g}" if cfg.mfu else "")],
        ["decode step", f"{fmt_seconds(decode.decode_step_s)} at batch {cfg.batch}, context {cfg.context}"],
        ["prefill : decode servers", f"{ratio:.2f} : 1 (servers of {cfg.chips} x {chip.name} each)"],
    ]
    return data, render(["quantity", "value"], rows)


def register(sub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser, with_chip) -> dict[str, Any]:
    """Add ``infer`` (estimate, sweep, topology, disaggregate, serve); return the ``infer`` subparsers."""
    ip = sub.add_parser("infer", help=help_of("infer"))
    isub = ip.add_subparsers(dest="infer_command", required=True, parser_class=Parser, metavar="COMMAND")
    ie = _register_estimate(isub, common)
    _register_sweep(isub, common)
    _register_topology(isub, common)
    _register_disaggregate(isub, common, hw, with_chip, ie)
    from lab.cli import serve

    serve.register(isub, common, _storage_dtype, MOE_WEIGHTS)
    return {"infer": isub}


def _register_estimate(isub, common):
    ie = isub.add_parser(
        "estimate",
        parents=[common, hardware_parent(required=False), model_parent(positional=False)],
        help="decode step, prefill, memory and cost of one serving configuration",
    )
    ie.add_argument(
        "--plan",
        type=in_path("--plan"),
        metavar="FILE",
        help="price exactly the decode this experiment file runs (its hardware unless --hardware), as named ops",
    )
    ie.add_argument("--chips", type=positive_int("--chips"), help="chips (required without --plan)")
    ie.add_argument("--batch", type=positive_int("--batch"), help="concurrent sequences (required without --plan)")
    ie.add_argument("--context", type=positive_int("--context"), help="tokens in each KV cache (required w/o --plan)")
    ie.add_argument("--prefill-len", type=positive_int("--prefill-len"))
    ie.add_argument("--generate", type=positive_int("--generate"), help="tokens to generate (mean context priced)")
    ie.add_argument("--weights", type=_storage_dtype, default="bf16", help="bf16, fp8, int8, int4 or fp32")
    ie.add_argument("--kv", type=_storage_dtype, default="bf16", help="bf16, fp8, int8 or int4")
    ie.add_argument(
        "--compute",
        type=dtype_arg,
        choices=("bf16", "fp8", "int8", "fp4"),
        default="bf16",
        help="matmul dtype (quantised weights still compute in bf16 unless this says otherwise; fp4 on Blackwell)",
    )
    ie.add_argument("--tp", type=positive_int("--tp"))
    ie.add_argument("--dp", type=positive_int("--dp"))
    ie.add_argument("--ep", type=positive_int("--ep"))
    ie.add_argument(
        "--mfu", type=fraction("--mfu"), help="prefill at this MFU (2 N tokens FLOPs) instead of the roofline"
    )
    add_ideal(ie)
    ie.add_argument(
        "--fp8-scaling",
        choices=FP8_SCALINGS,
        help="with --weights fp8 --compute fp8 (not --ideal): activation scales computed each step (vLLM, SGLang, "
        f"TorchAO; fp8 GEMMs take {FP8_DECODE_TIME_VS_BF16:g} of bf16's time) or static ones fused before (0.5) "
        "(default dynamic)",
    )
    ie.add_argument(
        "--moe-weights",
        choices=MOE_WEIGHTS,
        default="all",
        help="a mixture of experts' decode step streams every expert's weights (all: the dense einsum over experts "
        "common JAX implementations run at small batch; the default) or only those some token routed to (routed: "
        "vLLM's and SGLang's fused MoE kernels, JAX's megablox)",
    )
    add_step_overhead(ie)
    add_tp_allreduce(ie)
    add_attention_dp(ie)
    ie.add_argument(
        "--eager",
        action="store_true",
        help="one model per GPU (not --ideal): PyTorch eager generate (Hugging Face transformers without CUDA "
        "graphs or torch.compile), whose host issues every op from Python: a step takes the longer of the host's "
        f"time ({(eager_host_time(1) - eager_host_time(0)) * 1e3:.2f} ms a layer, measured) and the GPU's",
    )
    ie.add_argument("--continuous", action="store_true", help=argparse.SUPPRESS)  # gone: refused, naming infer serve
    # the Plan's dtypes and pricing mode: priced as it is built
    plan_options(
        ie,
        "weights",
        "kv",
        "compute",
        "mfu",
        "ideal",
        "fp8_scaling",
        "moe_weights",
        "step_overhead",
        "eager",
        "tp_allreduce",
        "attention_dp",
    )
    command(ie, cmd_infer_estimate)
    return ie


def _serving_args(p) -> None:
    p.add_argument("--context", type=positive_int("--context"), default=8192, help="tokens per KV cache")
    p.add_argument("--weights", type=_storage_dtype, default="bf16")
    p.add_argument("--kv", type=_storage_dtype, default="bf16")


def _register_sweep(isub, common) -> None:
    sw = isub.add_parser(
        "sweep",
        parents=[common, model_parent(positional=False)],
        help="latency vs throughput over batch sizes and topologies: Pareto table and PNG",
    )
    sw.add_argument("--hardware", required=True, metavar="NAME")
    sw.add_argument("--scale", type=scale_arg, metavar="FIELD=X,...")
    _serving_args(sw)
    sw.add_argument(
        "--chips", type=positive_ints("--chips"), metavar="N,N,...", help="topologies (tensor-parallel degrees) to try"
    )
    sw.add_argument(
        "--batches",
        type=positive_ints("--batches"),
        metavar="B,B,...",
        help="batch sizes to try (default powers of two and the max)",
    )
    add_ideal(sw)
    sw.add_argument("--png", type=chart_path("--png"), metavar="PATH")
    add_overwrite(sw)
    command(sw, cmd_infer_sweep)


def _register_topology(isub, common) -> None:
    tp_ = isub.add_parser(
        "topology",
        parents=[common, model_parent(positional=False)],
        help="the smallest slice for each weight precision",
    )
    tp_.add_argument("--hardware", required=True, metavar="NAME")
    tp_.add_argument("--scale", type=scale_arg, metavar="FIELD=X,...")
    tp_.add_argument("--context", type=positive_int("--context"), default=8192)
    command(tp_, cmd_infer_topology)


def _register_disaggregate(isub, common, hw, with_chip, ie) -> None:
    """``infer disaggregate`` takes ``infer estimate``'s serving flags (``ie``'s actions) as they are."""
    dg = isub.add_parser(
        "disaggregate",
        parents=[common, hw, model_parent(positional=False)],
        help="prefill servers per decode server that keep both saturated",
    )
    for action in ie._actions:
        if action.dest in (
            "chips",
            "batch",
            "context",
            "prefill_len",
            "generate",
            "weights",
            "kv",
            "compute",
            "tp",
            "dp",
            "ep",
            "mfu",
            "ideal",
            "fp8_scaling",
        ):
            dg._add_action(action)
    command(dg, with_chip(cmd_infer_disaggregate))
