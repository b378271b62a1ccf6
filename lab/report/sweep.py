"""A sweep's own report, beside its points' folders: ``summary.md`` (one row a point: the three step times, how far
measured departs from estimated, the audit, how far to trust the timing) and ``sweep.png`` (the step times across
the points, measured against estimated and predicted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.core.paths import chart_metadata
from lab.core.table import render
from lab.core.units import fmt_seconds

COLORS = {"estimated": "#4c72b0", "predicted": "#8c8c8c", "measured": "#dd8452"}


def _s(x: float | None) -> str:
    return "-" if x is None else fmt_seconds(x)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def table(summary: dict[str, Any]) -> str:
    rows = [
        [
            p["label"],
            _s(p["step_time_estimated_s"]),
            _s(p["step_time_predicted_s"]),
            _s(p["step_time_measured_s"]),
            _ratio(p["step_time_measured_s"], p["step_time_estimated_s"]),
            {True: "all match", False: "MISMATCH", None: "-"}[p["all_match"]],
            p.get("trust", "-"),
        ]
        for p in summary["points"]
    ]
    head = ["point", "estimated", "predicted", "measured", "meas/est", "audit", "timing"]
    return render(head, rows)


def markdown(summary: dict[str, Any]) -> str:
    """``summary.md``: what the sweep ran and each point's three step times (each point's own report beside)."""
    lines = [f"# {summary['experiment']}: sweep {summary['run_id']}", ""]
    if summary["emulated"]:
        lines += [
            "**Emulated**: CPU devices emulated on one host; structure is exact, timings are against a host "
            "calibration.",
            "",
        ]
    lines += [
        f"{len(summary['points'])} points. Estimated: the estimator's step; predicted: the roofline of each compiled "
        "op, summed; measured: the profiled step (median over the repeats). Timing: each point's trust verdict "
        "(steady, or UNSTEADY: read its ratios as noise). Each point's report: `points/<point>/report.md`.",
        "",
        "```",
        table(summary),
        "```",
        "",
        "Plot: `sweep.png`.",
        "",
    ]
    return "\n".join(lines)


def figure(summary: dict[str, Any]):
    """The three step times of every point, on a log axis when they span more than 10x."""
    from matplotlib.figure import Figure

    points = summary["points"]
    labels = [p["label"] for p in points]
    fig = Figure(figsize=(max(6.0, 0.9 * len(points) + 3), 4.5), dpi=100)
    ax = fig.subplots()
    xs = range(len(points))
    values = []
    for key, name, marker in (
        ("step_time_estimated_s", "estimated", "s"),
        ("step_time_predicted_s", "predicted", "^"),
        ("step_time_measured_s", "measured", "o"),
    ):
        ys = [p[key] for p in points]
        pts = [(x, y * 1e3) for x, y in zip(xs, ys, strict=True) if y]
        if pts:
            px, py = zip(*pts, strict=True)
            ax.plot(px, py, marker=marker, lw=1.2, color=COLORS[name], label=name)
            values += py
    if values and max(values) / max(min(values), 1e-12) > 10:
        ax.set_yscale("log")
    elif values:
        ax.set_ylim(0, 1.15 * max(values))
    ax.set_xticks(list(xs))
    long = max(map(len, labels)) > 8
    ax.set_xticklabels(labels, rotation=30 if long else 0, ha="right" if long else "center")
    ax.set_ylabel("step time (ms)")
    tag = " (emulated)" if summary["emulated"] else ""
    ax.set_title(f"{summary['experiment']}: step time per sweep point{tag}")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.subplots_adjust(left=0.12, right=0.97, top=0.9, bottom=0.22 if long else 0.12)
    return fig


def save_figure(summary: dict[str, Any], path: Path) -> bool:
    """Draw :func:`figure` to ``path`` where a point was measured (a compile-only sweep has no times to draw)."""
    if not any(p["step_time_measured_s"] for p in summary["points"]):
        return False
    figure(summary).savefig(path, metadata=chart_metadata(path.name))
    return True


__all__ = ["figure", "markdown", "save_figure", "table"]
