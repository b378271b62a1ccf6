"""Run reports: markdown, JSON, CSV and PNG plots of the ledger (predicted | compiled | measured per op)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from lab.core.table import dumps, render
from lab.core.units import fmt_bytes, fmt_seconds


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = ["name", "kind", "predicted_s", "measured_s", "ratio", "flops", "bytes", "collective_bytes", "scope"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def ledger_table(rows: list[dict[str, Any]], limit: int = 25) -> str:
    """The ledger's heaviest rows by measured time (then predicted)."""

    def key(r):
        return -(r["measured_s"] or 0.0), -(r["predicted_s"] or 0.0)

    shown = sorted(rows, key=key)[:limit]
    body = [
        [
            r["name"],
            r["kind"],
            fmt_seconds(r["predicted_s"]) if r["predicted_s"] is not None else "-",
            fmt_seconds(r["measured_s"]) if r["measured_s"] is not None else "-",
            f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
            fmt_bytes(r["collective_bytes"] or r["bytes"]) if (r["collective_bytes"] or r["bytes"]) else "-",
        ]
        for r in shown
    ]
    return render(["op", "kind", "predicted", "measured", "measured/predicted", "bytes"], body)


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    lines = [f"# {report['experiment']} ({report['run_id']})", ""]
    if report["emulated"]:
        lines += [
            "**Emulated**: these timings come from CPU devices emulated on one host; the interconnect is memory "
            "copies between threads. Structure (shardings, collectives, bytes, FLOPs) is exact; timings are "
            f"compared against a spec {'calibrated on this host' if hw.get('calibrated') else 'NOT calibrated'}.",
            "",
        ]
    lines += [
        f"- backend: {report['backend']} ({report['devices']} devices), mesh "
        f"{','.join(f'{k}={v}' for k, v in report['mesh'].items())}",
        f"- hardware spec: {hw['name']} (calibrated: {hw.get('calibrated', False)})",
        f"- step time: measured {fmt_seconds(report['step_time_measured_s'])}, predicted "
        f"{fmt_seconds(report['step_time_predicted_s'])}",
        f"- coverage: {100 * report['coverage']:.1f}% of measured op time is in predicted ops",
        f"- ops of at least 1 MB: median measured/predicted {report['summary']['median_ratio_large']}",
        f"- audit: {'all match' if report['audit']['all_match'] else 'MISMATCH'}",
        "",
        "## Ledger",
        "",
        "Measured: each op's own time (rendezvous waits excluded) on its slowest device, median over the repeats.",
        "",
        "```",
        ledger_table(report["ops"]),
        "```",
        "",
        "Plots: `roofline.png`, `predicted_vs_measured.png`, `breakdown.png`. Trace: `tensorboard --logdir "
        f"{report['tensorboard']}`.",
        "",
    ]
    return "\n".join(lines)


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """Roofline chart, predicted vs measured (log-log), and the step breakdown bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [r for r in report["ops"] if r["measured_s"]]
    hw = report["hardware"]
    peak = max(hw["peak_flops"].values())
    bw = hw["hbm_bandwidth"]
    written = []
    tag = " (emulated)" if report["emulated"] else ""

    fig, ax = plt.subplots(figsize=(7, 5))
    crit = peak / bw
    xs = [1e-2, crit, max(1e4, 10 * crit)]  # the ridge point is the critical intensity
    ax.plot(xs, [min(peak, x * bw) for x in xs], color="black", lw=1.5, label=f"{hw['name']} roof")
    ax.axvline(crit, color="gray", lw=0.8, ls=":")
    for kind in sorted({r["kind"] for r in ops}):
        pts = [
            (r["flops"] / r["bytes"], r["flops"] / r["measured_s"])
            for r in ops
            if r["kind"] == kind and r["flops"] > 0 and r["bytes"] > 0
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=kind, s=30)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"Roofline: {report['experiment']}{tag}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "roofline.png", dpi=110)
    plt.close(fig)
    written.append("roofline.png")

    fig, ax = plt.subplots(figsize=(6, 6))
    pts = [r for r in ops if r["predicted_s"]]
    if pts:
        lo = min(min(r["predicted_s"], r["measured_s"]) for r in pts) / 2
        hi = max(max(r["predicted_s"], r["measured_s"]) for r in pts) * 2
        ax.plot([lo, hi], [lo, hi], color="gray", ls="--", label="measured = predicted")
        for kind in sorted({r["kind"] for r in pts}):
            sel = [r for r in pts if r["kind"] == kind]
            ax.scatter([r["predicted_s"] for r in sel], [r["measured_s"] for r in sel], label=kind, s=30)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("predicted (s)")
    ax.set_ylabel("measured (s)")
    ax.set_title(f"Per op: predicted vs measured{tag}")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=110)
    plt.close(fig)
    written.append("predicted_vs_measured.png")

    fig, ax = plt.subplots(figsize=(7, 3))
    parts = report["breakdown"]
    labels = ["measured", "predicted"]
    left = [0.0, 0.0]
    colors = {"compute": "#4c72b0", "communication": "#dd8452", "other": "#8c8c8c"}
    for part in ("compute", "communication", "other"):
        vals = [parts["measured"][part], parts["predicted"][part]]
        ax.barh(labels, vals, left=left, color=colors[part], label=part)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("seconds per step (sum of op times)")
    ax.set_title(f"Step breakdown{tag}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=110)
    plt.close(fig)
    written.append("breakdown.png")
    return written


def breakdown(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Sum of op times by compute (matmul, attention), communication (collectives), other."""
    comm = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}

    def part(kind: str) -> str:
        return "communication" if kind in comm else ("compute" if kind in ("matmul", "attention") else "other")

    out = {s: {"compute": 0.0, "communication": 0.0, "other": 0.0} for s in ("measured", "predicted")}
    for r in rows:
        if r["measured_s"]:
            out["measured"][part(r["kind"])] += r["measured_s"]
        if r["predicted_s"]:
            out["predicted"][part(r["kind"])] += r["predicted_s"]
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def write_all(report: dict[str, Any], out: Path) -> list[str]:
    (out / "report.json").write_text(dumps(report))
    write_csv(report["ops"], out / "ops.csv")
    (out / "report.md").write_text(markdown(report))
    return ["report.json", "ops.csv", "report.md", *plots(report, out)]


__all__ = ["breakdown", "ledger_table", "markdown", "median", "plots", "write_all"]
