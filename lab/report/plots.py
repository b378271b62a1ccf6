"""The run's three plots: the roofline, predicted and estimated against measured per op, the step breakdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BAND = (0.67, 1.5)  # the measured/predicted band the validation criterion judges by


def _roofline(plt, report: dict[str, Any], out: Path, tag: str) -> str:
    ops = [r for r in report["ops"] if r["measured_s"]]
    hw = report["hardware"]
    peak = max(hw["peak_flops"].values())
    bw = hw["hbm_bandwidth"]
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
    return "roofline.png"


def _vs_measured(plt, report: dict[str, Any], out: Path, tag: str) -> str:
    """HLO ops: roofline prediction vs measured (dots, by kind); named ops: the estimator vs measured (crosses)."""
    pts = [r for r in report["ops"] if r["measured_s"] and r["predicted_s"]]
    named = [n for n in report.get("estimated_ops", []) if n["measured_s"] and n["estimated_s"]]
    fig, ax = plt.subplots(figsize=(6.5, 6))
    xs = [r["predicted_s"] for r in pts] + [n["estimated_s"] for n in named]
    ys = [r["measured_s"] for r in pts] + [n["measured_s"] for n in named]
    if xs:
        lo, hi = min(xs + ys) / 2, max(xs + ys) * 2
        ax.plot([lo, hi], [lo, hi], color="gray", ls="--", lw=1, label="measured = predicted")
        ax.fill_between(
            [lo, hi],
            [lo * BAND[0], hi * BAND[0]],
            [lo * BAND[1], hi * BAND[1]],
            color="gray",
            alpha=0.12,
            label=f"[{BAND[0]}, {BAND[1]}]",
        )
        for kind in sorted({r["kind"] for r in pts}):
            sel = [r for r in pts if r["kind"] == kind]
            ax.scatter(
                [r["predicted_s"] for r in sel], [r["measured_s"] for r in sel], label=f"{kind} (roofline)", s=24
            )
        if named:
            ax.scatter(
                [n["estimated_s"] for n in named],
                [n["measured_s"] for n in named],
                marker="x",
                s=60,
                color="black",
                label="named op (estimator)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("predicted or estimated (s)")
    ax.set_ylabel("measured (s)")
    ax.set_title(f"Per op: predicted vs measured{tag}")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=110)
    plt.close(fig)
    return "predicted_vs_measured.png"


def _breakdown(plt, report: dict[str, Any], out: Path, tag: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    parts = report["breakdown"]
    labels = [s for s in ("measured", "predicted", "estimated") if s in parts and any(parts[s].values())]
    left = [0.0] * len(labels)
    colors = {"compute": "#4c72b0", "communication": "#dd8452", "other": "#8c8c8c"}
    for part in ("compute", "communication", "other"):
        vals = [parts[s][part] for s in labels]
        ax.barh(labels, vals, left=left, color=colors[part], label=part)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("seconds per step (sum of op times)")
    ax.set_title(f"Step breakdown{tag}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=110)
    plt.close(fig)
    return "breakdown.png"


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """Roofline chart, predicted and estimated vs measured (log-log), and the step breakdown bars."""
    if report.get("compile_only"):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = " (emulated)" if report["emulated"] else ""
    return [f(plt, report, out, tag) for f in (_roofline, _vs_measured, _breakdown)]


__all__ = ["BAND", "plots"]
