"""``shardlab hardware``, ``roofline``, ``collective`` and ``sharded-matmul``: the analytic side, one chip at a time."""

from __future__ import annotations

import argparse

from lab.cli.args import (
    Parser,
    chip_of,
    command,
    dtype_arg,
    nonneg_float,
    parse_bytes,
    positive_int,
    positive_ints,
    warn,
)
from lab.cli.commands import help_of
from lab.core.errors import UserError
from lab.core.hardware import COLLECTIVE_KINDS, COLLECTIVE_SCOPES, default_catalog, scaleout_step_latency
from lab.core.table import render
from lab.core.units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds

TYPE_CHECKING = False  # typing is not imported at run time: annotations only
if TYPE_CHECKING:
    from typing import Any


def cmd_hardware_list(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    catalog = default_catalog(args.hardware_file)
    chips = catalog.chips()
    for message in catalog.broken.values():  # listed as the placeholder; pricing with it is refused
        warn(args, message)
    data = {
        "hardware": [
            {
                "name": c.name,
                "kind": c.kind,
                "aliases": list(c.aliases),
                "peak_flops": dict(c.peak_flops),
                "hbm_bytes": c.hbm_bytes,
                "hbm_bandwidth": c.hbm_bandwidth,
                "calibrated": c.calibrated,
            }
            for c in chips
        ]
    }
    rows = [
        [
            c.name,
            c.kind,
            fmt_rate(c.peak_flops.get("bf16", max(c.peak_flops.values())), "FLOP/s"),
            fmt_bytes(c.hbm_bytes),
            fmt_rate(c.hbm_bandwidth, "B/s"),
            f"{c.critical_intensity('bf16'):.0f}" if "bf16" in c.peak_flops else "-",
            fmt_rate(c.link_bandwidth, "B/s"),
            f"${c.price_per_hour:.2f}" if c.price_per_hour else "-",
            ", ".join(c.aliases),
        ]
        for c in chips
    ]
    text = render(
        ["name", "kind", "bf16 peak", "HBM", "HBM BW", "crit. int.", "link (1-way)", "$/chip-h", "aliases"], rows
    )
    return data, text + "\nPeaks are dense; 'crit. int.' is bf16 FLOPs per HBM byte. `shardlab hardware show NAME`"


def cmd_hardware_show(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    c = chip_of(args)
    d = c.to_dict()
    src = c.sources
    rows: list[list[str]] = []
    for dt, v in c.peak_flops.items():
        rows.append([f"peak {dt}", fmt_rate(v, "FLOP/s"), src.get(f"peak_flops.{dt}", "")])
    for dt in c.peak_flops:
        rows.append([f"critical intensity {dt}", f"{c.critical_intensity(dt):.1f} FLOP/B", "peak / HBM bandwidth"])
    rows += [
        ["HBM", fmt_bytes(c.hbm_bytes), src.get("hbm_bytes", "")],
        ["HBM bandwidth", fmt_rate(c.hbm_bandwidth, "B/s"), src.get("hbm_bandwidth", "")],
        [
            "topology",
            c.topology
            + (
                f" {c.torus_dims}D, pod {'x'.join(map(str, c.pod_shape or ()))}"
                if c.torus_dims
                else f", {c.node_size} per node"
            ),
            src.get("torus_dims", ""),
        ],
        ["link bandwidth (one way)", fmt_rate(c.link_bandwidth, "B/s"), src.get("link_bandwidth", "")],
        ["hop latency", fmt_seconds(c.hop_latency_s), src.get("hop_latency_s", "")],
        ["latency-bound below", f"{fmt_bytes(c.latency_bound_bytes)} per shard", "link bandwidth x hop latency"],
        ["scale-out per chip", fmt_rate(c.scaleout_bandwidth, "B/s"), src.get("scaleout_bandwidth", "")],
    ]
    if c.nics_per_node:
        nic = f"{c.nics_per_node} x {c.nic_bandwidth * 8 / 1e9:g} Gb/s per node" + (f", {c.fabric}" if c.fabric else "")
        rows.append(["scale-out NICs", nic, src.get("nics_per_node", "")])
    if c.topology != "torus":
        lat = scaleout_step_latency(c)
        rows.append(["step across nodes", fmt_seconds(lat), src.get("scaleout_latency_s", "") or "the chip's field"])
    if c.topology == "torus":
        rows.append(["wraparound", f"{c.wraparound_rule} ({c.wraparound_size})", src.get("wraparound_rule", "")])
    rows.append(
        [
            "price",
            f"${c.price_per_hour:.2f}/chip-hour" if c.price_per_hour else "not public",
            src.get("price_per_hour", ""),
        ]
    )
    aliases = f"; aliases: {', '.join(c.aliases)}" if c.aliases else ""
    title = f"{c.name} ({c.kind}{', calibrated' if c.calibrated else ''}{aliases})"
    text = render(["field", "value", "source"], rows, title=title)
    if c.notes:
        text += f"\nnote: {c.notes}"
    return d, text


def cmd_roofline_matmul(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.predict.roofline import matmul

    chip = chip_of(args)
    r = matmul(
        chip,
        args.b,
        args.d,
        args.f,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        out_dtype=args.out_dtype,
        compute_dtype=args.compute_dtype,
    )
    d = r.to_dict()
    text = render(
        ["quantity", "value"],
        [
            [
                "op",
                f"In[{r.b}, {r.d}] ({r.dtype}) @ W[{r.d}, {r.f}] ({r.weight_dtype}) -> [{r.b}, {r.f}] ({r.out_dtype})",
            ],
            ["hardware", f"{chip.name}, {r.compute_dtype} peak {fmt_rate(chip.flops(r.compute_dtype), 'FLOP/s')}"],
            ["flops", fmt_count(r.flops)],
            ["bytes", fmt_bytes(r.bytes)],
            ["intensity", f"{r.intensity:.1f} FLOP/B"],
            ["critical intensity", f"{r.critical_intensity:.1f} FLOP/B"],
            ["compute time", fmt_seconds(r.compute_s)],
            ["memory time", fmt_seconds(r.memory_s)],
            ["time (max)", fmt_seconds(r.time_s)],
            ["bound", r.bound],
            [
                "compute-bound above",
                f"B = {r.critical_batch:.0f} tokens" if r.critical_batch != float("inf") else "never (D, F too small)",
            ],
        ],
    )
    return d, text


def cmd_roofline_op(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.predict.roofline import roofline

    chip = chip_of(args)
    r = roofline(chip, args.flops, parse_bytes(args.bytes), args.dtype, op="op")
    text = render(
        ["quantity", "value"],
        [
            ["hardware", f"{chip.name}, {r.compute_dtype} peak {fmt_rate(chip.flops(r.compute_dtype), 'FLOP/s')}"],
            ["flops", fmt_count(r.flops)],
            ["bytes", fmt_bytes(r.bytes)],
            ["intensity", f"{r.intensity:.2f} FLOP/B"],
            ["critical intensity", f"{r.critical_intensity:.1f} FLOP/B"],
            ["compute time", fmt_seconds(r.compute_s)],
            ["memory time", fmt_seconds(r.memory_s)],
            ["time (max)", fmt_seconds(r.time_s)],
            ["bound", r.bound],
        ],
    )
    return r.to_dict(), text


def cmd_roofline_attention(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.predict.attention_blocks import search_blocks

    chip = chip_of(args)
    shape = {"b": args.b, "t": args.t, "s": args.s or args.t, "n": args.heads, "k": args.kv_heads, "h": args.head_dim}
    r = search_blocks(shape, chip, args.dtype, causal=shape["t"] == shape["s"], backward=args.backward)
    kernels = "forward, dq and dk/dv kernels" if r.backward else "forward kernel"
    head = (
        f"Pallas flash attention on {chip.name}, {r.dtype}, per chip: b={shape['b']} sequences, T={shape['t']}, "
        f"S={shape['s']}, {shape['n']} query and {shape['k']} KV heads of {shape['h']}"
        f"{', causal' if r.causal else ''}; the {kernels}\nVMEM {fmt_bytes(r.vmem_limit_bytes)} ({r.vmem_source})"
    )
    rows = [
        [
            f"{p.block_q} x {p.block_k}",
            fmt_seconds(p.time_s),
            fmt_seconds(p.compute_s),
            fmt_seconds(p.memory_s),
            fmt_seconds(p.overhead_s),
            fmt_bytes(p.vmem_bytes),
        ]
        for p in r.fitting[:5]
    ]
    table = render(["blocks (q x k)", "time", "compute", "HBM", "grid steps", "VMEM"], rows)
    tail = (
        f"best: block_q={r.best.block_q} block_k={r.best.block_k} ({len(r.fitting)} pairs fit, "
        f"{r.too_large} exceed VMEM)"
    )
    return r.to_dict(), f"{head}\n{table}\n{tail}"


def _wraparound(args: argparse.Namespace, chip) -> bool:
    """``not --no-wraparound``, refused where it would change nothing: wraparound is a torus axis' (ICI) property."""
    if args.no_wraparound and (chip.topology != "torus" or args.scope != "node"):
        where = f"{chip.name}'s {chip.topology}" if chip.topology != "torus" else "--scope cross-node (DCN)"
        raise UserError(f"--no-wraparound describes torus axes inside a slice, not {where}; drop it")
    return not args.no_wraparound


def cmd_collective(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.predict.collectives import canonical_kind, collective_time

    chip = chip_of(args)
    c = collective_time(
        canonical_kind(args.kind),
        parse_bytes(args.bytes),
        args.axis_size,
        chip,
        wraparound=_wraparound(args, chip),
        scope=args.scope,
    )
    d = c.to_dict()
    text = render(
        ["quantity", "value"],
        [
            ["collective", f"{c.kind} over axes {'x'.join(map(str, c.axis_sizes))} ({c.group_size} chips)"],
            ["hardware", f"{chip.name}, link {c.link}, scope {c.scope}"],
            ["bytes (V)", fmt_bytes(c.bytes)],
            [
                "wraparound",
                ", ".join("yes" if w else "no" for w in c.wraparound) if chip.topology == "torus" else "n/a",
            ],
            ["bandwidth term", fmt_seconds(c.bandwidth_s)],
            ["latency term", f"{fmt_seconds(c.latency_s)} ({c.hops} hops)"],
            ["time", fmt_seconds(c.time_s)],
            ["latency-bound", "yes" if c.latency_bound else "no"],
            ["formula", c.formula],
        ],
    )
    return d, text


def cmd_sharded_matmul(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from lab.core.notation import parse_matmul, parse_mesh, parse_sizes
    from lab.predict.program.sharded_matmul import plan_sharded_matmul

    chip = chip_of(args)
    mesh = parse_mesh(args.mesh)
    if args.chips is not None:
        prod = 1
        for v in mesh.values():
            prod *= v
        if prod != args.chips:
            raise UserError(
                f"--mesh {args.mesh} has {prod} devices but --chips is {args.chips}; "
                f"make the axis sizes multiply to {args.chips}"
            )
    expr, sizes = parse_matmul(args.expression), parse_sizes(args.sizes)
    named = {d for arr in (expr.lhs, expr.rhs, expr.out) if arr is not None for d in arr.dim_names}
    unused = [k for k in sizes if k not in named]
    if unused:  # a misspelt dim would otherwise be ignored (the real one then fails as missing)
        raise UserError(
            f"--sizes {unused[0]}={sizes[unused[0]]} names no dim of {expr} (its dims: {', '.join(sorted(named))}); "
            "drop it"
        )
    plan = plan_sharded_matmul(
        expr,
        sizes,
        mesh,
        chip,
        args.dtype,
        wraparound=_wraparound(args, chip),
        scope=args.scope,
    )
    d = plan.to_dict()
    rows = [
        [c.describe(), fmt_bytes(c.bytes), fmt_seconds(c.time_s), "yes" if c.cost.latency_bound else "no"]
        for c in plan.collectives
    ]
    text = f"{plan.expression}   on {chip.name}, mesh {args.mesh}, {plan.dtype}\n"
    text += f"book case(s): {', '.join(map(str, plan.cases))}   output: {plan.output}\n\n"
    text += render(["collective", "bytes (V)", "time", "latency-bound"], rows) if rows else "no communication"
    text += "\n\n" + render(
        ["quantity", "value"],
        [
            ["local matmul", f"{plan.lhs_local} * {plan.rhs_local}"],
            ["flops per device", fmt_count(plan.local.flops)],
            ["compute (roofline)", f"{fmt_seconds(plan.compute_s)} ({plan.local.bound}-bound)"],
            ["communication", fmt_seconds(plan.comm_s)],
            ["time, no overlap", fmt_seconds(plan.time_s)],
            ["time, ideal overlap", fmt_seconds(plan.overlapped_time_s)],
        ],
    )
    for n in plan.notes:
        text += f"\nnote: {n}"
    return d, text


def _add_roofline_attention(rsub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser) -> None:
    ra = rsub.add_parser(
        "attention", parents=[common, hw], help="the Pallas flash kernel's block sizes for one chip's attention"
    )
    ra.add_argument("--b", type=positive_int("--b"), required=True, help="sequences on the chip")
    ra.add_argument("--t", type=positive_int("--t"), required=True, help="query length T")
    ra.add_argument("--s", type=positive_int("--s"), help="key length S (default: T; causal when S == T)")
    ra.add_argument("--heads", type=positive_int("--heads"), required=True, help="query heads on the chip")
    ra.add_argument("--kv-heads", type=positive_int("--kv-heads"), required=True, help="KV heads on the chip")
    ra.add_argument("--head-dim", type=positive_int("--head-dim"), required=True, help="head dimension H")
    ra.add_argument("--dtype", type=dtype_arg, default="bf16", help="q, k, v dtype (default bf16)")
    ra.add_argument("--backward", action="store_true", help="also the dq and dk/dv kernels (a train step)")
    command(ra, cmd_roofline_attention)


def register(sub, common: argparse.ArgumentParser, hw: argparse.ArgumentParser) -> None:
    """Add ``hardware``, ``roofline``, ``collective`` and ``sharded-matmul`` to the ``shardlab`` parser."""
    h = sub.add_parser("hardware", help=help_of("hardware"))
    hsub = h.add_subparsers(dest="hw_command", required=True, parser_class=Parser, metavar="list|show")
    hl = hsub.add_parser("list", parents=[common], help="every chip with its headline numbers")
    command(hl, cmd_hardware_list)
    hs = hsub.add_parser("show", parents=[common], help="one chip, every number with its source")
    hs.add_argument("hardware", metavar="NAME")
    command(hs, cmd_hardware_show)

    r = sub.add_parser("roofline", help=help_of("roofline"))
    rsub = r.add_subparsers(dest="rf_command", required=True, parser_class=Parser, metavar="matmul|op|attention")
    rm = rsub.add_parser("matmul", parents=[common, hw], help="In[B, D] @ W[D, F] on one chip")
    rm.add_argument("--b", type=positive_int("--b"), required=True, help="token batch B")
    rm.add_argument("--d", type=positive_int("--d"), required=True, help="contracting dim D")
    rm.add_argument("--f", type=positive_int("--f"), required=True, help="output dim F")
    rm.add_argument("--dtype", type=dtype_arg, default="bf16", help="activation dtype (default bf16)")
    rm.add_argument("--weight-dtype", type=dtype_arg, help="weight dtype (default: --dtype), e.g. int8")
    rm.add_argument("--out-dtype", type=dtype_arg, help="output dtype (default: --dtype)")
    rm.add_argument(
        "--compute-dtype",
        type=dtype_arg,
        help="dtype whose peak applies (default: the wider of --dtype and --weight-dtype)",
    )
    command(rm, cmd_roofline_matmul, allowed=lambda key, _: key == "critical_batch")  # inf: never
    ro = rsub.add_parser("op", parents=[common, hw], help="any op given its FLOPs and HBM bytes")
    ro.add_argument(
        "--flops", type=nonneg_float("--flops"), default=0.0, help="floating-point operations (default 0: a pure copy)"
    )
    ro.add_argument("--bytes", required=True, metavar="V", help="HBM bytes read plus written: 1048576, 1Mi, fp32[1024]")
    ro.add_argument("--dtype", type=dtype_arg, default="bf16", help="dtype whose peak applies (default bf16)")
    command(ro, cmd_roofline_op)
    _add_roofline_attention(rsub, common, hw)

    c = sub.add_parser("collective", parents=[common, hw], help=help_of("collective"))
    c.add_argument("kind", metavar="KIND", help=f"one of {', '.join(COLLECTIVE_KINDS)}")
    c.add_argument(
        "--bytes",
        required=True,
        metavar="V",
        help="per-device array in its unsharded-over-these-axes form (AllGather output, "
        "ReduceScatter input, AllReduce array): 33554432, 32Mi or bf16[2048,8192]",
    )
    c.add_argument(
        "--axis-size",
        type=positive_ints("--axis-size"),
        required=True,
        metavar="N[,N2,...]",
        help="size of each mesh axis the collective spans",
    )
    c.add_argument("--no-wraparound", action="store_true", help="torus axes without wraparound links")
    c.add_argument(
        "--scope",
        choices=COLLECTIVE_SCOPES,
        default="node",
        help="node: one ICI slice or NVLink node; cross-node: DCN or the scale-out network",
    )
    command(c, cmd_collective)

    s = sub.add_parser(
        "sharded-matmul",
        parents=[common, hw],
        help=help_of("sharded-matmul"),
    )
    s.add_argument("expression", metavar="EXPR", help='the book\'s notation, e.g. "A[I,J_X] * B[J_X,K] -> C[I,K_X]"')
    s.add_argument("--sizes", required=True, help="dim sizes, e.g. I=1024,J=8192,K=4096")
    s.add_argument("--mesh", required=True, help="mesh axis sizes, e.g. X=2,Y=4")
    s.add_argument("--chips", type=positive_int("--chips"), help="check that the mesh has this many chips")
    s.add_argument("--dtype", type=dtype_arg, default="bf16")
    s.add_argument("--no-wraparound", action="store_true")
    s.add_argument("--scope", choices=COLLECTIVE_SCOPES, default="node")
    command(s, cmd_sharded_matmul)


__all__ = ["register"]
