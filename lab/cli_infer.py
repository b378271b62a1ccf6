"""Command line of the inference estimator (registered by :mod:`lab.cli`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lab.cli_train import _model, model_parent
from lab.errors import UserError
from lab.inference import WEIGHT_DTYPES, InferConfig, estimate_inference
from lab.table import render
from lab.units import fmt_bytes, fmt_count, fmt_seconds

GiB = 2**30


def _storage_dtype(text: str) -> str:
    from lab.units import canonical_dtype

    try:
        dt = canonical_dtype(text)
    except UserError:
        dt = None
    if dt not in WEIGHT_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a storage dtype; valid: {', '.join(WEIGHT_DTYPES)}")
    return dt


def _warn_context(model, context: int) -> None:
    if context > model.max_seq_len:
        print(
            f"shardlab: warning: --context {context} exceeds {model.name}'s trained context of "
            f"{model.max_seq_len}; estimating anyway",
            file=sys.stderr,
        )


def infer_config(args: argparse.Namespace, chip) -> InferConfig:
    model = _model(args)
    n = args.chips
    for name in ("tp", "dp", "ep"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name} must be a positive integer, got {v}")
    tp, dp, ep = args.tp, args.dp, args.ep or 1
    if tp is None and dp is None:
        tp = n // ep  # generation shards the model, not the batch (inference.md)
    elif tp is None:
        tp = n // (dp * ep) if n % (dp * ep) == 0 else 0
    if dp is None:
        dp = n // (tp * ep) if tp and n % (tp * ep) == 0 else 0
    if not tp or not dp or tp * dp * ep != n:
        raise UserError(
            f"tp x dp x ep must equal --chips {n}; got tp={args.tp}, dp={args.dp}, ep={ep} "
            f"(leave one out to fill the rest)"
        )
    _warn_context(model, args.context)
    return InferConfig(
        model=model,
        chip=chip,
        batch=args.batch,
        context=args.context,
        tp=tp,
        dp=dp,
        ep=ep,
        weights=args.weights,
        kv=args.kv,
        compute=args.compute,
        prefill_len=args.prefill_len,
        generate=args.generate,
        mfu=args.mfu,
        achievable=args.achievable,
    )


def cmd_infer_estimate(args: argparse.Namespace, chip) -> tuple[dict[str, Any], str]:
    cfg = infer_config(args, chip)
    e = estimate_inference(cfg)
    m = cfg.model
    rows = [
        [
            "model / hardware",
            f"{m.name} on {cfg.chips} x {chip.name} (tp={cfg.tp} dp={cfg.dp} ep={cfg.ep}), "
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
        ["decode step", f"{fmt_seconds(e.decode_step_s)} ({e.bound}-bound)"],
        ["  KV reads", fmt_seconds(e.kv_s)],
        ["  weight reads / FLOPs", f"{fmt_seconds(e.weights_s)} / {fmt_seconds(e.compute_s)}"],
        ["  collectives", fmt_seconds(e.comm_s) + ("  (latency-bound)" if e.latency_bound_collectives else "")],
        ["throughput", f"{fmt_count(e.tokens_per_s)} tokens/s ({e.tokens_per_s_per_chip:,.0f} per chip)"],
        ["TP limit (memory-bound)", f"{e.tp_max_degree:.0f}-way at this batch (F / (B W_hbm / W_ici))"],
    ]
    if e.prefill_s is not None:
        rows.append(
            [
                "prefill / TTFT",
                f"{fmt_seconds(e.prefill_s)} for {cfg.prefill_len} tokens x {cfg.batch}"
                + (f" at MFU {cfg.mfu:g}" if cfg.mfu else ""),
            ]
        )
    if e.generate_s is not None:
        rows.append(["generate", f"{fmt_seconds(e.generate_s)} for {cfg.generate} tokens"])
    if e.cost_per_million_tokens_usd is not None:
        rows.append(["cost", f"${e.cost_per_million_tokens_usd:.3f} per million tokens"])
    return e.to_dict(), render(["quantity", "value"], rows)


def register(sub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser, with_chip) -> dict[str, Any]:
    """Add ``infer estimate`` (and return the ``infer`` subparsers for the other inference commands)."""
    from lab.cli import _dtype, _Parser, _positive_int

    ip = sub.add_parser("infer", help="serving estimates: decode, prefill, KV cache, topology")
    isub = ip.add_subparsers(dest="infer_command", required=True, parser_class=_Parser, metavar="COMMAND")
    ie = isub.add_parser(
        "estimate",
        parents=[common, hw, model_parent(positional=False)],
        help="decode step, prefill, memory and cost of one serving configuration",
    )
    ie.add_argument("--chips", type=_positive_int("--chips"), required=True)
    ie.add_argument("--batch", type=_positive_int("--batch"), required=True, help="concurrent sequences")
    ie.add_argument("--context", type=_positive_int("--context"), required=True, help="tokens in each KV cache")
    ie.add_argument("--prefill-len", type=_positive_int("--prefill-len"))
    ie.add_argument("--generate", type=_positive_int("--generate"), help="tokens to generate (mean context priced)")
    ie.add_argument("--weights", type=_storage_dtype, default="bf16", help="bf16, fp8, int8 or int4")
    ie.add_argument("--kv", type=_storage_dtype, default="bf16", help="bf16, fp8, int8 or int4")
    ie.add_argument(
        "--compute",
        type=_dtype,
        choices=("bf16", "fp8", "int8"),
        default="bf16",
        help="matmul dtype (quantised weights still compute in bf16 unless this says otherwise)",
    )
    ie.add_argument("--tp", type=int)
    ie.add_argument("--dp", type=int)
    ie.add_argument("--ep", type=int)
    ie.add_argument("--mfu", type=float, help="prefill at this MFU (2 N tokens FLOPs) instead of the roofline")
    ie.add_argument("--achievable", action="store_true", help="apply the efficiency model instead of ideal peaks")
    ie.set_defaults(func=with_chip(cmd_infer_estimate))
    return {"infer": isub}
