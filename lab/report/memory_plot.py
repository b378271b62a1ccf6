"""The memory timeline of ``shardlab explain memory``: live bytes per device over XLA's schedule, stacked by role,
the peak marked, XLA's own total (``memory_analysis``) as a line."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lab.compile.memory import ROLES, MemoryExplanation
from lab.core.units import fmt_bytes

COLORS = {
    "parameter": "#4c72b0",
    "optimizer state": "#8172b3",
    "gradient": "#dd8452",
    "activation": "#55a868",
    "kv cache": "#64b5cd",
    "collective": "#c44e52",
    "temporary": "#bbbbbb",
    "input": "#937860",
    "output": "#da8bc3",
}


def plot_timeline(result: MemoryExplanation, path: str | Path) -> None:
    """Write the timeline of ``result`` to ``path`` (any format matplotlib writes, by its suffix)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(10, 5.2), dpi=100)
    ax = fig.subplots()
    roles = [r for r in ROLES if r in result.timeline]
    x = np.arange(result.schedule_length)
    ys = [result.timeline[r] for r in roles]
    ax.stackplot(x, *ys, labels=roles, colors=[COLORS[r] for r in roles], linewidth=0, step="post")
    p = result.peak_position
    ax.axvline(p, color="black", linewidth=1, linestyle=":")
    ax.annotate(
        f"peak {fmt_bytes(result.live_bytes)} live\nat position {p}",
        xy=(p, result.live_bytes),
        xytext=(8, -4),
        textcoords="offset points",
        va="top",
        fontsize=9,
    )
    ax.axhline(result.xla_peak_bytes, color="black", linewidth=1, linestyle="--")
    ax.annotate(
        f"XLA memory_analysis {fmt_bytes(result.xla_peak_bytes)}",
        xy=(0, result.xla_peak_bytes),
        xytext=(4, 4),
        textcoords="offset points",
        fontsize=9,
    )
    ax.set_ylim(0, max(result.xla_peak_bytes, result.live_bytes) * 1.15)
    ax.set_xlim(0, max(result.schedule_length - 1, 1))
    ax.yaxis.set_major_formatter(EngFormatter(unit="B", sep=" "))
    ax.set_xlabel("position in XLA's schedule (instructions, loop bodies flattened once)")
    ax.set_ylabel("live bytes per device")
    ax.set_title(f"{result.target}: memory over the compiled schedule ({result.where})", fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    fig.subplots_adjust(left=0.09, right=0.8, top=0.92, bottom=0.11)
    fig.savefig(path)


__all__ = ["COLORS", "plot_timeline"]
