"""``shardlab infer serve``: requests under load on one deployment, simulated (registered by :mod:`lab.cli.infer`)."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    add_overwrite,
    chart_path,
    chip_of,
    command,
    dtype_arg,
    hardware_parent,
    in_path,
    nonneg_int,
    positive_float,
    positive_int,
    text_arg,
    write_chart,
)
from lab.cli.model_args import model_of, model_parent
from lab.cli.stack_args import add_attention_dp, add_step_overhead, add_tp_allreduce
from lab.core.errors import UserError
from lab.core.limits import MAX_CHIPS_SEARCHED, MAX_REQUESTS

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any

PAGE_SIZE_MAX = 1024  # tokens a page: vLLM's block sizes are 8-128
MAX_SEQS_MAX = 65_536
TOKEN_BUDGET_MAX = 1 << 20
PAGES_MAX = 1 << 22  # 4Mi pages: 64Mi tokens of 16, more than any chip's memory holds for a model


def _bounded(flag: str, value: int, most: int, what: str) -> None:
    if value > most:
        raise UserError(f"{flag} {value:,} is more than {what}; give at most {most:,}")


def _lengths(text: str):
    from lab.core.serving import Lengths

    try:
        return Lengths.parse(text, "")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


_lengths.kind = "lengths"


def _deployment(args: argparse.Namespace, chip):
    """The InferConfig of ``--chips`` split as ``--tp`` x ``--dp`` (tensor parallel first, as infer estimate)."""
    from lab.predict.inference.estimate import check_infer
    from lab.predict.inference.from_plan import fill_degrees, infer_config, serving_plan

    model = model_of(args)
    tp, dp, _ = fill_degrees(args.chips, args.tp, args.dp)
    cfg = infer_config(
        serving_plan(model, batch=dp, tp=tp, dp=dp),
        chip,
        weights=args.weights,
        kv=args.kv,
        compute=args.compute,
        moe_weights=args.moe_weights,
        step_overhead_s=args.step_overhead,
        tp_allreduce=args.tp_allreduce,
        attention_dp=args.attention_dp,
    )
    check_infer(cfg)
    return cfg


def _load(args: argparse.Namespace, model):
    from lab.core.serving import load_trace
    from lab.studies.serving_load import Load

    _bounded("--requests", args.requests, MAX_REQUESTS, "one simulation runs in minutes")
    if args.concurrency is not None:
        _bounded("--concurrency", args.concurrency, MAX_REQUESTS, "the requests a simulation takes")
    if args.trace is not None:
        if args.rate is not None or args.concurrency is not None:
            raise UserError("--trace gives the arrivals; drop --rate and --concurrency")
        trace = tuple(load_trace(args.trace))
        _bounded("--trace's requests", len(trace), MAX_REQUESTS, "one simulation runs in minutes")
        longest = max(r.prompt_len + r.output_len for r in trace)
        prompt = output = None
    else:
        if (args.rate is None) == (args.concurrency is None):
            raise UserError("give the load: --rate R (Poisson requests/s) or --concurrency C (clients), one of them")
        trace, prompt, output = None, args.prompt_len, args.output_len
        longest = prompt.hi + output.hi
    if longest > model.max_seq_len:
        raise UserError(
            f"a request of {longest:,} tokens (prompt and output) is longer than {model.name}'s context of "
            f"{model.max_seq_len:,}; give shorter --prompt-len / --output-len"
        )
    return Load(
        requests=len(trace) if trace else args.requests,
        prompt=prompt or trace_lengths(trace, "prompt_len"),
        output=output or trace_lengths(trace, "output_len"),
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        trace=trace,
    )


def trace_lengths(trace, field: str):
    """The range a trace's lengths span (what its capacity is measured with)."""
    from lab.core.serving import Lengths

    values = [getattr(r, field) for r in trace]
    return Lengths(min(values), max(values))


def cmd_infer_serve(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.serving import PoolConfig
    from lab.predict.inference.serve import Slo, pool_for
    from lab.studies.serving_load import search, serve

    for flag, value, most in (
        ("--page-size", args.page_size, PAGE_SIZE_MAX),
        ("--max-seqs", args.max_seqs, MAX_SEQS_MAX),
        ("--token-budget", args.token_budget, TOKEN_BUDGET_MAX),
        ("--pages", args.pages or 1, PAGES_MAX),
    ):
        _bounded(flag, value, most, "any serving engine uses")
    chip = chip_of(args)
    cfg = _deployment(args, chip)
    load = _load(args, cfg.model)
    slo = Slo.parse(args.slo, args.slo_percentile) if args.slo is not None else None

    def pool_of(c):
        auto = pool_for(c, args.page_size, args.max_seqs, args.token_budget)
        return auto if args.pages is None else PoolConfig(args.pages, args.page_size, args.max_seqs, args.token_budget)

    if args.search:
        if slo is None or args.rate is None:
            raise UserError("--search finds the fewest chips holding a rate within a target: give --rate and --slo")
        _bounded("--max-chips", args.max_chips, MAX_CHIPS_SEARCHED, "a search tries in reasonable time")
        best, rows = search(cfg, load, slo, args.max_chips, pool_of)
        if best is None:
            raise UserError(
                f"no deployment of up to {args.max_chips} x {chip.name} holds {args.rate:g} requests/s within {slo}; "
                "try a larger --max-chips or a looser --slo"
            )
        best.candidates = rows
        result = best
    else:
        result = serve(cfg, load, pool_of(cfg), slo)
    data, text = result.to_dict(), result.table()
    if args.png is not None:
        png = write_chart(args.png, "", result.plot)
        data["png"] = png
        text += f"\n\nchart: {png}"
    return data, text


def register(isub, common: argparse.ArgumentParser, storage_dtype, moe_weights) -> None:
    """Add ``infer serve`` to the ``infer`` subparsers."""
    sv = isub.add_parser(
        "serve",
        parents=[common, hardware_parent(), model_parent(positional=False)],
        help="requests under load (continuous batching, paged KV cache), simulated: TTFT/TPOT percentiles, the "
        "rate a latency target allows, the fewest chips that hold a rate",
    )
    sv.add_argument("--chips", type=positive_int("--chips"), default=1, help="chips in all (default 1)")
    sv.add_argument("--tp", type=positive_int("--tp"), help="tensor-parallel chips per replica (default all)")
    sv.add_argument("--dp", type=positive_int("--dp"), help="data-parallel replicas")
    load = sv.add_argument_group("load")
    load.add_argument("--rate", type=positive_float("--rate", "10 or 0.5"), help="Poisson arrivals, requests/s")
    load.add_argument("--concurrency", type=positive_int("--concurrency"), help="or: clients, one request each")
    load.add_argument("--trace", type=in_path("--trace"), metavar="FILE", help="or: a JSON-lines file of requests")
    load.add_argument("--prompt-len", type=_lengths, default="512", metavar="N|LO-HI", help="default 512")
    load.add_argument("--output-len", type=_lengths, default="128", metavar="N|LO-HI", help="default 128")
    load.add_argument("--requests", type=positive_int("--requests"), default=1000, help="simulated (default 1000)")
    load.add_argument("--seed", type=nonneg_int("--seed"), default=0, help="of the arrivals and lengths")
    eng = sv.add_argument_group("engine")
    eng.add_argument("--weights", type=storage_dtype, default="bf16")
    eng.add_argument("--kv", type=storage_dtype, default="bf16")
    eng.add_argument("--compute", type=dtype_arg, choices=("bf16", "fp8", "int8"), default="bf16")
    eng.add_argument("--moe-weights", choices=moe_weights, default="all")
    add_step_overhead(eng)
    add_tp_allreduce(eng)
    add_attention_dp(eng)
    eng.add_argument("--page-size", type=positive_int("--page-size"), default=16, help="tokens a KV page (16)")
    eng.add_argument("--pages", type=positive_int("--pages"), help="KV pages per replica (default: what HBM holds)")
    eng.add_argument("--max-seqs", type=positive_int("--max-seqs"), default=256, help="running at once (256)")
    eng.add_argument("--token-budget", type=positive_int("--token-budget"), default=2048, help="tokens a step")
    tgt = sv.add_argument_group("targets")
    tgt.add_argument(
        "--slo",
        type=text_arg("--slo", "ttft=0.5s,tpot=50ms"),
        metavar="ttft=0.5s,tpot=50ms",
        help="latency targets (ttft, tpot, e2e in s, ms or us): the highest rate meeting them",
    )
    tgt.add_argument("--slo-percentile", type=int, choices=(50, 90, 99), default=90, help="judged at (p90)")
    tgt.add_argument("--search", action="store_true", help="with --rate and --slo: the fewest chips that hold them")
    tgt.add_argument("--max-chips", type=positive_int("--max-chips"), default=8, help="searched up to (8)")
    sv.add_argument("--png", type=chart_path("--png"), metavar="PATH", help="KV pool use and TTFT over time")
    add_overwrite(sv)
    command(sv, cmd_infer_serve)


__all__ = ["register"]
