"""``shardlab model``: the model catalog and one model's accounting (parameters, FLOPs per token, KV bytes)."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    Parser,
    command,
    dtype_arg,
    positive_int,
)
from lab.cli.commands import help_of
from lab.cli.model_args import model_of, model_parent
from lab.core.models import CATALOG
from lab.core.table import render
from lab.core.units import canonical_dtype, fmt_bytes, fmt_count

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def _first_clause(source: str, width: int = 72) -> str:
    """A source as the list shows it: up to its first semicolon or colon, at most ``width`` characters."""
    short = source.split(";", 1)[0].split(": ", 1)[0]
    return short if len(short) <= width else short[: width - 3] + "..."


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
            _first_clause(m.source),
        ]
        for m in CATALOG
    ]
    text = render(["name", "params", "active", "L", "D", "F", "N", "K", "V", "source"], rows)
    text += "\n`shardlab model show NAME` gives a model's whole source and what its sizes leave out"
    return {"models": [m.to_dict() for m in CATALOG]}, text


def _window_rows(m, kv: str) -> list[list[str]]:
    """A sliding window's row: how many layers it holds to how many positions, and a long context's cache."""
    if not m.window_layers:
        return []
    at = max(m.max_seq_len, m.sliding_window)
    return [
        [
            "sliding window",
            f"{m.sliding_window} token{'s' if m.sliding_window > 1 else ''} on {m.window_layers} of {m.layers} "
            f"layers ({m.global_layers} attend to "
            f"everything); one sequence's cache at {at:,} tokens: {fmt_bytes(m.kv_bytes(at, kv))}",
        ]
    ]


def _kv_note(m) -> str:
    return " (every layer; a windowed one stops growing at its window)" if m.window_layers else ""


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
        [
            "layers / d_model / d_ff",
            f"{m.layers} / {m.d_model} / {m.d_ff}"
            + (" (gated)" if m.gated_mlp else "")
            + (" (parallel block)" if m.parallel_block else ""),
        ],
        ["heads / kv_heads / head_dim", f"{m.heads} / {m.kv_heads} / {m.head_dim}"],
        *_window_rows(m, kv),
        ["vocab", f"{m.vocab}" + (" (tied)" if m.tied_embeddings else "")],
        [f"KV cache per token ({kv})", fmt_bytes(m.kv_bytes_per_token(kv)) + _kv_note(m)],
        [
            "training FLOPs per token",
            f"{fmt_count(d['flops_per_token'])} ({d['flops_convention']}"
            + (f", seq {args.seq_len})" if args.seq_len else ")"),
        ],
        ["source", m.source],
    ]
    return d, render(["quantity", "value"], rows, title=m.name)


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


def register(sub, common, hw, with_chip) -> None:
    _register_model(sub, common, hw, with_chip)


__all__ = ["register"]
