"""The run's three plots: the roofline, predicted and estimated against measured per op, the step breakdown.

:func:`figures` builds them as matplotlib ``Figure`` s (no pyplot, fixed margins: ``tight_layout`` costs more than
drawing), so a test can read what they show; :func:`plots` saves them as PNG.

* ``roofline.png``: the roof of the program's dtype on the chip it was priced for (peak, HBM bandwidth and the
  ridge labelled), every op with FLOPs at its measured rate, the heaviest named; beside it the collectives: their
  bus bandwidth (nccl-tests' convention, :func:`bus_factor`), measured and predicted, against message size under
  the link's roof (a collective-only run is not an empty chart).
* ``predicted_vs_measured.png``: each HLO op's roofline prediction (dots, by kind, sized by measured time) and each
  of the estimator's named ops (crosses) against measured, the [0.67, 1.5] band drawn, the heaviest named, ops
  under 1 us left out and counted in the title.
* ``breakdown.png``: the measured step split by class of op (bars that add up to the measured step: op times
  scaled to it, what is left is idle or waiting, a pipeline's measured bubble first; a line under it says how),
  the roofline's sum of op times, and the estimator's step.

Over 500 lines on purpose: the three charts share their layout helpers (fixed margins, titles placed without
measuring, labels that avoid one another, log axes), and splitting the charts apart would import those across
modules for no reader's gain.
"""
# Over 500 lines on purpose: the run's three plots share their style, markers, numbering and key.

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from lab.core.collective_kinds import HLO_NAMES, from_hlo
from lab.core.paths import chart_metadata

BAND = (0.67, 1.5)  # the measured/predicted band the validation criterion judges by
TINY_S = 1e-6  # ops shorter than this are left out of the per-op chart (and counted)
LABELLED = 5  # how many of the heaviest ops are named on a chart
COMM_KINDS = (*HLO_NAMES, "permute")  # a ledger row's HLO name, or an estimator op's kind
COLORS = {
    "compute": "#4c72b0",
    "communication": "#dd8452",
    "other": "#8c8c8c",
    "bubble": "#c44e52",
    "idle": "#e5e5e5",
}


def _load() -> None:
    try:
        from matplotlib import font_manager
        from matplotlib.backends import backend_agg  # noqa: F401  (savefig's canvas)
        from matplotlib.figure import Figure  # noqa: F401

        font_manager.fontManager  # noqa: B018  (the font cache, read on the first text drawn)
    except Exception:  # the plots import it again and say what is wrong
        return


_PRELOADING: list[threading.Thread] = []


def preload() -> threading.Thread:
    """Import matplotlib on a daemon thread while the devices compile (XLA releases the GIL), so the report pays for
    drawing only: its import is about 1 s on a 2-core host, more than writing the three plots."""
    t = threading.Thread(target=_load, name="shardlab-preload-plots", daemon=True)
    t.start()
    _PRELOADING.append(t)
    return t


def preloaded() -> None:
    """Wait for :func:`preload`'s import to finish. Before a trace starts: JAX's profiler records every Python call
    of every thread, and an import running meanwhile made tp_mlp's trace 12x larger (1 MB of xplane, not 90 kB) and
    its parse 10x slower."""
    while _PRELOADING:
        _PRELOADING.pop().join()


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.subplots(1, ncols)


def _eng(x: float, unit: str) -> str:
    """``x`` in engineering notation with its unit: ``46 GFLOP/s``, ``775 MB/s``."""
    from matplotlib.ticker import EngFormatter

    return EngFormatter(unit=unit, sep=" ")(float(f"{x:.4g}"))


def _log_axes(ax, x_unit: str, y_unit: str) -> None:
    """Both axes logarithmic, ticks in engineering units (``100 us``, ``10 TFLOP/s``) as plain text: matplotlib's
    default ``10^n`` labels go through its mathtext layout, a third of the charts' drawing time. Minor ticks are
    labelled where the axis spans too little for major ones, as matplotlib's own log formatter decides."""
    from matplotlib.ticker import EngFormatter, LogFormatter, LogLocator

    class EngLog(LogFormatter):
        def __init__(self, unit: str, **kw) -> None:
            super().__init__(**kw)
            self.eng = EngFormatter(unit=unit, sep=" " if unit else "")

        def _num_to_string(self, x, vmin, vmax):
            return self.eng(x)

    class Minor(LogLocator):
        """Minor ticks only where the axis spans two decades or less: wider, every decade has a labelled major
        tick, the formatter labels no minor one, and each unlabelled tick still costs as much to lay out."""

        def tick_values(self, vmin, vmax):
            lo, hi = sorted((vmin, vmax))
            if lo > 0 and hi / lo > 100:
                import numpy as np

                return np.array([])
            return super().tick_values(vmin, vmax)

    ax.set(xscale="log", yscale="log")
    for axis, unit in ((ax.xaxis, x_unit), (ax.yaxis, y_unit)):
        axis.set_major_formatter(EngLog(unit))
        # minor ticks at 2 and 5 of each decade, not all eight: each tick is an object matplotlib lays out, and
        # the default's were a third of the drawing time
        axis.set_minor_locator(Minor(base=10, subs=(2.0, 5.0)))
        # every minor tick labelled where there are any (two decades or less), not a subset of them: matplotlib's
        # default left a tick at 500 MB/s bare beside a labelled 1 GB/s
        axis.set_minor_formatter(EngLog(unit, labelOnlyBase=False, minor_thresholds=(2, 2)))


def _title(ax, text: str) -> None:
    """The title just above the axes. Placed there, not where matplotlib finds room for it: finding room measures
    every tick label of the axes once more, a fifth of a chart's drawing time, and these axes have nothing above."""
    ax.set_title(text, y=1.0)


LABEL_STEP = 0.04  # a 7-point label's height, as a share of a chart's axes (about 3.7 in tall), and some room
LABEL_GAP = 0.025  # between a point and its label, as a share of the axes' width: clear of the largest marker


def _label(ax, items: list[tuple[str, float, float]], left_of: float | None = None, taken=()) -> None:
    """Name the points ``(text, x, y)`` (on log-log axes), heaviest first, each label beside its point or, where
    an earlier one already sits there, at the nearest free place above or below (below first), with a line back
    to its point: a cluster of heavy ops (a train step's matmuls) gets readable names, not a pile of them.
    ``left_of``: points right of this x get their label on their left. ``taken``: labels already drawn,
    ``(text, x, y)`` right-aligned at ``x`` and standing on ``y``, that none may cover."""
    ax.autoscale_view()
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    width_in, _ = _inches(ax)
    placed: list[tuple[float, float, float, float]] = []  # (left, right, bottom, top), axes fractions

    def frac(v: float, lo: float, hi: float) -> float:
        return (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    def wide(text: str, points: float = 7) -> float:  # a character is about 0.55 of its size wide
        return len(text) * points * 0.55 / 72 / width_in

    for text, x, y in taken:
        fx, fy = frac(x, x0, x1), frac(y, y0, y1)
        placed.append((fx - wide(text, 8), fx, fy, fy + LABEL_STEP))
    for text, x, y in items:
        fx, fy = frac(x, x0, x1), frac(y, y0, y1)
        left = left_of is not None and x > left_of
        box_x = (fx - LABEL_GAP - wide(text), fx - LABEL_GAP) if left else (fx + LABEL_GAP, fx + LABEL_GAP + wide(text))
        ty = next((t for t in _places(fy) if _free(placed, box_x, t)), fy)
        placed.append((*box_x, ty - LABEL_STEP / 2, ty + LABEL_STEP / 2))
        ax.annotate(
            text,
            (x, y),
            xytext=(box_x[1] if left else box_x[0], ty),
            textcoords="axes fraction",
            fontsize=7,
            ha="right" if left else "left",
            va="center",
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "gray"} if ty != fy else None,
        )


def _places(fy: float) -> list[float]:
    """Where a label of a point at height ``fy`` (axes fraction) may go, nearest first: beside it, then one label's
    height below, above, two below, ... inside the axes."""
    steps = [0] + [sign * k for k in range(1, int(1 / LABEL_STEP) + 1) for sign in (-1, 1)]
    return [fy + k * LABEL_STEP for k in steps if 0.0 <= fy + k * LABEL_STEP <= 1.0]


def _free(placed: list[tuple[float, ...]], box_x: tuple[float, float], ty: float) -> bool:
    """Whether a label spanning ``box_x`` centred at ``ty`` covers none of ``placed``."""
    lo, hi = ty - LABEL_STEP / 2, ty + LABEL_STEP / 2
    return not any(box_x[0] < b[1] and b[0] < box_x[1] and lo < b[3] and b[2] < hi for b in placed)


def _short(name: str, n: int = 22) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


KEY_WIDTH = 70  # characters of a name in a chart's key before it is cut


def _numbered(ax, items: list[tuple[str, float, float]], left_of: float | None = None, taken=(), note: str = ""):
    """Number the points ``(name, x, y)`` 1, 2, ... beside each (placed as :func:`_label` places names, so none
    covers another) and write the key, number and whole name, in a box in the axes' lower right corner (where a
    measured-against-predicted or roofline chart has no points): long names stay readable, not cut at a label's
    width. ``note`` heads the key (what the marks mean)."""
    _label(ax, [(str(i), x, y) for i, (_, x, y) in enumerate(items, 1)], left_of=left_of, taken=taken)
    lines = [note] if note else []
    lines += [f"{i}  {_short(name, KEY_WIDTH)}" for i, (name, _, _) in enumerate(items, 1)]
    if lines:
        ax.text(
            0.98,
            0.02,
            "\n".join(lines),
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            multialignment="left",
            fontsize=6.5,
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#cccccc", "alpha": 0.9},
        )


def roof(hw: dict[str, Any], dtype: str) -> tuple[float, str]:
    """The peak the program's dtype runs at on the chip, and the dtype it is (the widest the chip has else)."""
    peaks = hw["peak_flops"]
    if dtype in peaks:
        return peaks[dtype], dtype
    wide = "fp32" if "fp32" in peaks else ("bf16" if "bf16" in peaks else next(iter(peaks)))
    return peaks[wide], wide


def _roof_note(report: dict[str, Any], memory: str, above: int) -> str:
    """What the roof is, and why a dot may sit above it, under the chart."""
    text = (
        f"roof: the spec's peak, or its {memory} bandwidth x the op's FLOPs per byte, whichever is lower "
        "(each op's own bytes; fused ops read less)"
    )
    if above:
        why = (
            "one device thread can take more than its share of the host's cores, which the calibration measured "
            "all busy at once"
            if report.get("emulated")
            else "the spec or the op's FLOP and byte count is off"
        )
        text += f";\na dot above it ran faster than the spec allows: {why}"
    return text


def _roofline(report: dict[str, Any], tag: str):
    hw = report["hardware"]
    peak, dtype = roof(hw, report.get("dtype", "bf16"))
    bw = hw["hbm_bandwidth"]
    fig, (ax, cx) = _figure(11, 5.1, 2)
    fig.subplots_adjust(left=0.12, right=0.98, top=0.9, bottom=0.17, wspace=0.33)
    ops = [r for r in report["ops"] if r["measured_s"] and r["flops"] > 0 and r["bytes"] > 0]
    crit = peak / bw
    lo = min([r["flops"] / r["bytes"] for r in ops] + [crit / 100]) / 2
    hi = max([r["flops"] / r["bytes"] for r in ops] + [crit * 10]) * 2
    ax.plot([lo, crit, hi], [lo * bw, peak, peak], color="black", lw=1.5, label=f"{hw['name']} {dtype} roof")
    ax.axvline(crit, color="gray", lw=0.8, ls=":")
    peak_text = f"peak {_eng(peak, 'FLOP/s')} ({dtype})"
    ax.annotate(peak_text, (hi, peak), ha="right", va="bottom", fontsize=8)
    # the ridge named at the foot of its line, on its left: the key of the heaviest ops holds the lower right
    ax.annotate(
        f"ridge {crit:.3g} FLOP/B",
        (crit, 0.0),
        xycoords=("data", "axes fraction"),
        xytext=(-3, 4),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="gray",
    )
    for kind in sorted({r["kind"] for r in ops}):
        sel = [r for r in ops if r["kind"] == kind]
        ax.scatter(
            [r["flops"] / r["bytes"] for r in sel], [r["flops"] / r["measured_s"] for r in sel], s=24, label=kind
        )
    heavy: dict[str, tuple[str, float, float]] = {}
    for r in sorted(ops, key=lambda r: -r["measured_s"]):  # the heaviest ops, one label per name
        label = r.get("estimate_op") or r["name"]
        if label not in heavy and len(heavy) < LABELLED:
            heavy[label] = (label, r["flops"] / r["bytes"], r["flops"] / r["measured_s"])
    _log_axes(ax, "", "FLOP/s")
    _numbered(ax, list(heavy.values()), taken=[(peak_text, hi, peak)], note="the heaviest ops:")
    ax.set(
        xlabel="arithmetic intensity (FLOPs / byte)",
        ylabel="achieved FLOP/s",
    )
    # an op above its roof ran faster than the spec allows: a spec or FLOP count to question (on emulated devices,
    # the host's threads sharing its cores unevenly against a calibration of all of them at once)
    above = sum(1 for r in ops if r["flops"] / r["measured_s"] > min(peak, r["flops"] / r["bytes"] * bw))
    note = f"; {above} op{'s' if above != 1 else ''} above the roof" if above else ""
    _title(ax, f"Roofline: {report['experiment']}{tag}{note}")
    ax.legend(fontsize=7, loc="upper left")  # above the HBM roof: where no op can be
    memory = "host memory" if report.get("emulated") else "HBM"  # emulated devices share the host's RAM
    hbm = ax.annotate(f"{memory} {_eng(bw, 'B/s')}", (lo * 2, lo * 2 * bw), xytext=(0, 3), textcoords="offset points")
    fig.text(0.01, 0.01, _roof_note(report, memory, above), ha="left", va="bottom", fontsize=7, color="#555555")
    hbm.set(ha="left", va="bottom", fontsize=8, rotation=_decade_angle(ax), rotation_mode="anchor")
    _collectives(cx, report)
    return fig


def _decade_angle(ax) -> float:
    """The angle on the page, in degrees, of a line rising a decade per decade on log-log axes (a bandwidth roof),
    once the axes' limits are final: a label set at it runs along the roof at any aspect and range."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    w, h = _inches(ax)
    per_x, per_y = w / math.log10(x1 / x0), h / math.log10(y1 / y0)  # inches per decade
    return math.degrees(math.atan2(per_y, per_x))


def _inches(ax) -> tuple[float, float]:
    """The axes' width and height on the page, in inches."""
    box, (w, h) = ax.get_position(), ax.figure.get_size_inches()
    return box.width * w, box.height * h


def bus_factor(kind: str, group: int) -> float:
    """What a collective of ``V`` bytes (the lab's V: lab.predict.collectives) moves out of each chip, per ``V``:
    nccl-tests' bus bandwidth, so that its achieved rate compares with the link's. A ring AllReduce sends
    ``2 (n - 1) / n V``, an AllGather or ReduceScatter ``(n - 1) / n V``, a permute ``V``; an AllToAll's V is the
    whole array, each device holding ``V / n`` and sending ``(n - 1) / n`` of that."""
    if group <= 1:
        return 1.0
    if kind == "all-reduce":
        return 2.0 * (group - 1) / group
    if kind in ("all-gather", "reduce-scatter"):
        return (group - 1) / group
    if kind == "all-to-all":
        return (group - 1) / group**2
    return 1.0


def _group(report: dict[str, Any], r: dict[str, Any]) -> int | None:
    """The devices a collective's group spans: the product of its mesh axes; None where the row names none."""
    mesh, axes = report.get("mesh") or {}, r.get("axes")
    if not axes or any(a not in mesh for a in axes):
        return None
    return math.prod(int(mesh[a]) for a in axes)


def _kind_roof(hw: dict[str, Any], kind: str, link: float) -> float | None:
    """A calibrated host's bus-bandwidth roof for one collective kind: the link over the factor its bandwidth term
    was measured at for the whole mesh (lab.predict.collectives prices the term x factor); None uncalibrated."""
    factors = (hw.get("calibration") or {}).get("collective_factor") or {}
    factor = factors.get(from_hlo(kind))
    if not factor or abs(float(factor) - 1) < 0.02:  # the link's own roof already (AllGather's is the fit itself)
        return None
    return link / float(factor)


def _collectives(ax, report: dict[str, Any]) -> None:
    """Each collective's bus bandwidth (measured: dots; its prediction: rings) against its message size, under the
    link's one-way roof and, on a calibrated host, each kind's own fitted roof (dotted, in its colour). A collective
    whose group is not known is drawn at ``V / time`` (and counted in the title)."""
    hw = report["hardware"]
    comm = [r for r in report["ops"] if r["measured_s"] and r["kind"] in COMM_KINDS and r["collective_bytes"] > 0]
    link = hw.get("link_bandwidth") or hw["hbm_bandwidth"]
    sizes = [r["collective_bytes"] for r in comm] or [1e3, 1e7]
    xs = [min(sizes) / 2, max(sizes) * 2]
    # priced for the host, a collective is copies in its memory, and the "link" the calibration's fit to AllGather
    if hw.get("kind") == "cpu":
        what = "host link fit (AllGather)" if hw.get("calibrated") else "host link (not calibrated)"
    else:
        what = "link, one way"
    roofs = [(link, f"{what} {_eng(link, 'B/s')}", "-", 1.5)]
    if hw.get("topology") == "torus":  # a ring of a torus runs both ways (and a group over k axes uses k rings)
        roofs.append((2 * link, "link, both ways", "--", 1.0))
    for y, label, style, width in roofs:
        ax.plot(xs, [y, y], color="black", lw=width, ls=style, label=label)
    unknown, ys = 0, [y for y, *_ in roofs]
    for i, kind in enumerate(sorted({r["kind"] for r in comm})):
        sel = [r for r in comm if r["kind"] == kind]
        groups = [_group(report, r) for r in sel]
        if from_hlo(kind) != "permute":  # a send's factor is 1 whatever its group
            unknown += sum(g is None for g in groups)
        moved = [r["collective_bytes"] * bus_factor(kind, g or 1) for r, g in zip(sel, groups, strict=True)]
        color, v = f"C{i}", [r["collective_bytes"] for r in sel]
        measured = [b / r["measured_s"] for b, r in zip(moved, sel, strict=True)]
        ax.scatter(v, measured, s=24, color=color, label=kind)
        own = _kind_roof(hw, kind, link)
        if own is not None:  # the calibration's own fit for this kind: the roof its predictions are priced under
            ax.plot(xs, [own, own], color=color, lw=1.0, ls=":", label=f"{kind} fit, whole mesh {_eng(own, 'B/s')}")
            ys.append(own)
        priced = [(x, b / r["predicted_s"]) for x, b, r in zip(v, moved, sel, strict=True) if r.get("predicted_s")]
        if priced:
            ax.scatter(*zip(*priced, strict=True), s=40, facecolors="none", edgecolors=color, lw=1.0)
        ys += measured + [y for _, y in priced]
    if comm:  # one legend entry for every kind's rings
        ax.scatter([], [], s=40, facecolors="none", edgecolors="gray", lw=1.0, label="predicted")
    _log_axes(ax, "B", "B/s")
    ax.set(xlabel="message V (bytes)", ylabel="bus bandwidth (B/s)")
    title = f"Collectives ({len(comm)})" if comm else "Collectives (none in this program)"
    _title(ax, title + (f"; {unknown} at V / time (group unknown)" if unknown else ""))
    ax.set_ylim(min(ys) / 2, max(ys) * 6)  # room above the highest point for the legend: nothing drawn under it
    ax.legend(fontsize=7, loc="upper left")


def _vs_measured(report: dict[str, Any], tag: str):
    """HLO ops: roofline prediction vs measured (dots, by kind); named ops: the estimator vs measured (crosses)."""
    every = [r for r in report["ops"] if r["measured_s"] and r["predicted_s"]]
    pts = [r for r in every if r["measured_s"] >= TINY_S]
    hidden = len(every) - len(pts)
    named = [n for n in report.get("estimated_ops", []) if n["measured_s"] and n["estimated_s"]]
    fig, ax = _figure(6.8, 6.2)
    fig.subplots_adjust(left=0.13, right=0.97, top=0.9, bottom=0.1)
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
            alpha=0.15,
            label=f"band [{BAND[0]}, {BAND[1]}]",
        )
        top = max(ys)
        for kind in sorted({r["kind"] for r in pts}):
            sel = [r for r in pts if r["kind"] == kind]
            sizes = [12 + 200 * r["measured_s"] / top for r in sel]
            dots = ax.scatter(
                [r["predicted_s"] for r in sel],
                [r["measured_s"] for r in sel],
                s=sizes,
                alpha=0.75,
                label=f"{kind} (roofline)",
            )
            _spread_bars(ax, [r for r in sel if r.get("spread")], dots.get_facecolor()[0])
        if named:
            ax.scatter(
                [n["estimated_s"] for n in named],
                [n["measured_s"] for n in named],
                marker="x",
                s=60,
                color="black",
                label="named op (estimator)",
            )
        # number the heaviest: the estimator's ops where there are some (one each), else the HLO ops
        heavy = [(n["name"], n["estimated_s"], n["measured_s"]) for n in named]
        heavy = heavy or [(r["name"], r["predicted_s"], r["measured_s"]) for r in pts]
        _log_axes(ax, "s", "s")
        heaviest = sorted(heavy, key=lambda h: -h[2])[:LABELLED]
        note = "dot area: measured time; bar: its repeats' spread"
        # points right of the middle get their number on their left
        _numbered(ax, heaviest, left_of=math.sqrt(lo * hi), note=note)
        ax.legend(fontsize=7, loc="upper left")
    note = f"; {hidden} ops under 1 us left out" if hidden else ""
    ax.set(
        xlabel="predicted (roofline) or estimated (s)",
        ylabel="measured (s)",
    )
    _title(ax, f"Per op: predicted vs measured{tag}{note}")
    return fig


def _spread_bars(ax, rows: list[dict[str, Any]], color) -> None:
    """A vertical bar through each op's measured dot spanning its repeats' spread (slowest over fastest, centred
    on the median in log space: ``measured / sqrt(spread)`` to ``measured x sqrt(spread)``)."""
    if not rows:
        return
    ys = [r["measured_s"] for r in rows]
    half = [math.sqrt(r["spread"]) for r in rows]
    ax.errorbar(
        [r["predicted_s"] for r in rows],
        ys,
        yerr=[[y - y / h for y, h in zip(ys, half, strict=True)], [y * h - y for y, h in zip(ys, half, strict=True)]],
        fmt="none",
        ecolor=color,
        elinewidth=0.8,
        alpha=0.6,
    )


def step_bars(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The breakdown's bars, seconds per step, each adding up to its step: ``measured`` (the measured pipeline
    bubble first, then the op times scaled to the rest of the measured step where they exceed it, the remainder
    idle), ``predicted`` (the roofline's sum of op times, the step_time_predicted_s it is reported as) and
    ``estimated`` (the estimator's step, split like its ops). :func:`placement` says how the measured bar was made."""
    parts = report["breakdown"]
    bars: dict[str, dict[str, float]] = {}
    fill = _measured_fill(report)
    if fill is not None:
        step, busy, room = fill
        scale = min(1.0, room / busy)  # ops overlap across devices: never more than the step itself
        bars["measured"] = (
            {k: v * scale for k, v in parts["measured"].items()}
            | ({"bubble": step - room} if room < step else {})
            | {"idle": max(0.0, room - busy * scale)}
        )
    bars["predicted"] = dict(parts["predicted"])
    est, est_parts = report.get("step_time_estimated_s"), parts.get("estimated", {})
    if est and sum(est_parts.values()):
        total = sum(est_parts.values())
        bars["estimated"] = {k: v * est / total for k, v in est_parts.items()}
    return bars


def _measured_fill(report: dict[str, Any]) -> tuple[float, float, float] | None:
    """The measured step, the sum of its op times, and the room they fill: the step less the pipeline's measured
    bubble (the stages' idle steps, drawn as the bubble); None without a measured step or op times."""
    step, busy = report.get("step_time_measured_s"), sum(report["breakdown"]["measured"].values())
    if not step or not busy:
        return None
    return step, busy, step * (1 - (report.get("pipeline_bubble") or {}).get("measured", 0.0))


def placement(report: dict[str, Any]) -> str | None:
    """How the measured bar places the op times in the step, in one line (None without a measured step)."""
    from lab.core.units import fmt_seconds

    fill = _measured_fill(report)
    if fill is None:
        return None
    step, busy, room = fill
    if busy <= room:
        return (
            f"measured: op times (each on its slowest device) sum to {fmt_seconds(busy)} of the "
            f"{fmt_seconds(step)} step;\nthe rest is idle"
        )
    return (
        f"measured: op times (each on its slowest device) sum to {fmt_seconds(busy)}, more than the "
        f"{fmt_seconds(room)} they can fill\n(ops on different devices overlap): drawn x{room / busy:.2f}"
        + ("; the bubble is the trace's share of idle pipeline steps" if room < step else "")
    )


def _breakdown(report: dict[str, Any], tag: str):
    bars = step_bars(report)
    note = placement(report)
    fig, ax = _figure(7.5, 3.4 if note else 3.1)
    fig.subplots_adjust(left=0.13, right=0.97, top=0.85, bottom=0.34 if note else 0.28)
    labels = list(bars)
    left = [0.0] * len(labels)
    for part in ("compute", "communication", "other", "bubble", "idle"):
        vals = [bars[b].get(part, 0.0) for b in labels]
        if any(vals):
            ax.barh(labels, vals, left=left, color=COLORS[part], label=part)
            left = [a + b for a, b in zip(left, vals, strict=True)]
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(unit="s", sep=" "))
    ax.set(xlabel="per step")
    _title(ax, f"Step breakdown{tag}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=5, frameon=False)
    if note:
        fig.text(0.5, 0.02, note, ha="center", va="bottom", fontsize=7, color="#555555")
    return fig


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The three charts of a report with measurements (and a serve run's load), by file name."""
    tag = " (emulated)" if report["emulated"] else ""
    drawn = {
        "roofline.png": _roofline(report, tag),
        "predicted_vs_measured.png": _vs_measured(report, tag),
        "breakdown.png": _breakdown(report, tag),
    }
    if report.get("serving"):  # a serve run's load (lab.report.serving)
        from lab.report import serving

        drawn["serving.png"] = serving.figure(report["serving"], tag)
    return drawn


# Glyphs rasterised as their outlines give them, without FreeType's hinting to the pixel grid (matplotlib's default):
# laying out and drawing the charts' text is most of their time, and without the hinting tp_mlp's three charts cost
# 14% fewer instructions (1.62 G -> 1.39 G, matplotlib 3.11), to the eye alike at their size.
FAST_TEXT = {"text.hinting": "no_hinting"}


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """Save :func:`figures` under ``out`` (nothing for a compile-only report)."""
    if report.get("compile_only"):
        return []
    import matplotlib

    with matplotlib.rc_context(FAST_TEXT):
        drawn = figures(report)
        for name, fig in drawn.items():
            # zlib at its fastest: a third of the drawing
            fig.savefig(out / name, pil_kwargs={"compress_level": 1}, metadata=chart_metadata(name))
    return list(drawn)


__all__ = ["BAND", "figures", "placement", "plots", "preload", "preloaded", "roof", "step_bars"]
