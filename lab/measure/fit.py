"""Fit the calibration's timings into the ``cpu`` chip's numbers: pure functions, no JAX.

:mod:`lab.measure.calibrate` measures (plain lists of ``[x, seconds]`` points) and describes (sources, notes);
everything in between lives here, so each step can be tested alone on made-up timings. Each function returns
the :class:`Fit` terms it fixed, in the order the calibration table lists them, and the chip fields they give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab.core.errors import UserError
from lab.core.hardware import Chip
from lab.predict.collectives import KINDS as MODEL_KINDS
from lab.predict.collectives import collective_time

HBM_SLOPE = "slope of time vs bytes"
HBM_FALLBACK = "achieved at the largest size (slope not positive)"
LATENCY_LINE = "line t = launch + (G-1)*hop"
LATENCY_HOPS_ONLY = "launch and hop not separable here, so launch = 0 and hop = t/(G-1)"


@dataclass(frozen=True)
class Fit:
    """One fitted (or measured) term of the calibrated chip.

    Attributes:
        term: the chip field or calibration entry (``peak_flops.fp32``, ``hbm_bandwidth``, ``link_bandwidth``,
            ``hop_latency_s``, ``launch_latency_s``, ``collective_factor.all-to-all``, ``hbm_bytes``).
        value: in SI units (FLOP/s, bytes/s, seconds, bytes) or a plain factor.
        r2: coefficient of determination where a line was fitted, else None.
        points: measurements behind the value.
        note: how it was obtained.
    """

    term: str
    value: float
    r2: float | None
    points: int
    note: str = ""


def line(x: Sequence[float], y: Sequence[float], intercept: float | None = None) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x`` (``a`` fixed when ``intercept`` is given): ``(a, b, R^2)``."""
    n = len(x)
    if intercept is None:
        mx, my = sum(x) / n, sum(y) / n
        sxx = sum((xi - mx) ** 2 for xi in x)
        b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx if sxx else 0.0
        a = my - b * mx
    else:
        a = intercept
        sxx = sum(xi * xi for xi in x)
        b = sum(xi * (yi - a) for xi, yi in zip(x, y, strict=True)) / sxx if sxx else 0.0
    my = sum(y) / n
    ss_tot = sum((yi - my) ** 2 for yi in y)
    ss_res = sum((yi - a - b * xi) ** 2 for xi, yi in zip(x, y, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return a, b, r2


def best_matmul(rows: Sequence[Sequence[float]]) -> Sequence[float]:
    """The ``[n, seconds, FLOP/s]`` row with the highest achieved FLOP/s."""
    return max(rows, key=lambda r: r[2])


def peak_flops(matmul: Mapping[str, Sequence[Sequence[float]]]) -> tuple[dict[str, float], list[Fit]]:
    """Peak FLOP/s per dtype from one device's ``[n, seconds, FLOP/s]`` matmul rows.

    Args:
        matmul: per dtype (``fp32``, ``bf16``), one row per square size ``n``.

    Returns:
        The best median FLOP/s per dtype (XLA:CPU may spread one device's dot over several host threads, so
        no size is assumed to be the fastest), and a ``peak_flops.<dtype>`` fit for each.
    """
    peaks: dict[str, float] = {}
    fits: list[Fit] = []
    for short, rows in matmul.items():
        best = best_matmul(rows)
        peaks[short] = best[2]
        fits.append(
            Fit(f"peak_flops.{short}", best[2], None, len(rows), f"best median of a@b on 1 device, n={best[0]}")
        )
    return peaks, fits


def hbm_bandwidth(inplace: Sequence[Sequence[float]]) -> tuple[Fit, str]:
    """Memory bandwidth from ``[bytes read + written, seconds]`` of an in-place copy at several sizes.

    Returns:
        The ``hbm_bandwidth`` fit (1 / slope of time against bytes) and how it was obtained:
        :data:`HBM_SLOPE`, or :data:`HBM_FALLBACK` (no R^2) when the slope is not positive.
    """
    xs, ys = [p[0] for p in inplace], [p[1] for p in inplace]
    _, slope, r2 = line(xs, ys)
    if slope > 0:
        bw, how = 1.0 / slope, HBM_SLOPE
    else:  # noise swamped the slope: fall back to the achieved bandwidth at the largest size
        bw, how, r2 = xs[-1] / ys[-1], HBM_FALLBACK, None
    return Fit("hbm_bandwidth", bw, r2, len(xs), f"in-place x*1.0001 on 1 device, {how}"), how


def hbm_bytes(ram: float, devices: int) -> Fit:
    """Memory capacity per emulated device: the host's RAM shared evenly."""
    return Fit("hbm_bytes", ram / devices, None, 1, f"host RAM / {devices} emulated devices")


def latency(groups: Sequence[int], seconds: Sequence[float]) -> tuple[Fit, Fit, str]:
    """Launch and per-hop latency from one small AllGather's in-program time over groups of several sizes.

    On the switch model a latency-regime AllGather over ``G`` devices takes ``launch + (G - 1) * hop``.

    Args:
        groups: the group size ``G`` of each measurement.
        seconds: the time of one collective over each group.

    Returns:
        The ``launch_latency_s`` and ``hop_latency_s`` fits and how they were obtained: :data:`LATENCY_LINE`,
        or :data:`LATENCY_HOPS_ONLY` (launch 0, no R^2) when fewer than two groups or a line with a negative
        launch or a non-positive hop leave the two terms inseparable.
    """
    hops = [float(size - 1) for size in groups]
    lats = list(seconds)
    launch, hop, r2 = line(hops, lats) if len(hops) >= 2 else (0.0, 0.0, None)
    how = LATENCY_LINE
    if not (hop > 0 and launch >= 0):  # not separable: charge the whole latency to the hops
        launch, r2 = 0.0, None
        hop = max(sum(t * h for t, h in zip(lats, hops, strict=True)) / sum(h * h for h in hops), 1e-9)
        how = LATENCY_HOPS_ONLY
    return (
        Fit("launch_latency_s", launch, r2, len(lats), "AllGather latency regime: intercept"),
        Fit("hop_latency_s", hop, r2, len(lats), "AllGather latency regime: per (G-1) step"),
        how,
    )


def model_slopes(base: Chip, axis_sizes: tuple[int, ...]) -> dict[str, float]:
    """Seconds per byte of V for each kind on ``base`` with a 1 B/s link and factor 1 (the calibrated form)."""
    probe = dataclasses.replace(
        base,
        link_bandwidth=1.0,
        hop_latency_s=0.0,
        launch_latency_s=0.0,
        calibration={"collective_factor": dict.fromkeys(MODEL_KINDS, 1.0)},
    )
    return {k: collective_time(k, 1.0, axis_sizes, probe).bandwidth_s for k in MODEL_KINDS}


def _slope(points: Sequence[Sequence[float]], launch: float) -> tuple[float, float]:
    """Slope (seconds per byte of V) and R^2 of ``t = launch + b V`` through ``[V, seconds]`` points."""
    _, b, r2 = line([p[0] for p in points], [p[1] for p in points], intercept=launch)
    return b, r2


def collective_factors(
    points: Mapping[str, Sequence[Sequence[float]]], launch: float, slopes: Mapping[str, float], group: int
) -> tuple[float, dict[str, float], list[Fit]]:
    """Link bandwidth and a factor per kind from the bandwidth regime over every mesh axis.

    Each kind's line ``t = launch + b V`` is fitted by least squares, so the large messages dominate.
    AllGather's slope fixes the link bandwidth; every kind's factor is then its slope over the model's.

    Args:
        points: per kind (every one of :data:`lab.predict.collectives.KINDS`), ``[V, seconds]`` per size.
        launch: the launch latency, the intercept of every line.
        slopes: :func:`model_slopes` over every mesh axis.
        group: the number of devices the collectives span.

    Returns:
        ``link_bandwidth``, the factor per kind, and the fits: ``link_bandwidth`` just before
        ``collective_factor.all-gather``, then one ``collective_factor.<kind>`` per kind.

    Raises:
        UserError: the AllGather times did not grow with size.
    """
    lines = {kind: _slope(points[kind], launch) for kind in MODEL_KINDS}
    b_ag = lines["all-gather"][0]
    if not b_ag > 0:
        raise UserError("calibrate: the AllGather times did not grow with size; the host is too noisy, run it again")
    link_bw = slopes["all-gather"] / b_ag
    factors: dict[str, float] = {}
    fits: list[Fit] = []
    for kind in MODEL_KINDS:
        b, r2 = lines[kind]
        if not b > 0:  # a flat kind: keep the model's own slope
            b = slopes[kind] / link_bw
        factors[kind] = b * link_bw / slopes[kind]
        if kind == "all-gather":
            fits.append(
                Fit("link_bandwidth", link_bw, r2, len(points[kind]), f"AllGather over {group}: (G-1)/G / slope")
            )
        fits.append(
            Fit(
                f"collective_factor.{kind}",
                factors[kind],
                r2,
                len(points[kind]),
                f"V/t {1 / b / 1e9:.2f} GB/s measured vs {link_bw / slopes[kind] / 1e9:.2f} modelled",
            )
        )
    return link_bw, factors, fits


def axis_factors(
    points: Mapping[str, Sequence[Sequence[float]]],
    axis: str,
    size: int,
    slopes: Mapping[str, float],
    launch: float,
    link_bw: float,
) -> tuple[dict[str, float], list[Fit]]:
    """A factor per kind for collectives over one mesh axis, at the link bandwidth fitted over every axis.

    On one host a smaller group is not proportionally cheaper (every device still copies through the same
    memory), so each kind gets its own line per axis.

    Args:
        points: per kind, ``[V, seconds]`` per size over ``axis``.
        axis: the mesh axis' name.
        size: its size, the group ``G``.
        slopes: :func:`model_slopes` for ``(size,)``.
        launch: the launch latency, the intercept of every line.
        link_bw: the link bandwidth :func:`collective_factors` fitted.

    Returns:
        The factor of each kind whose line has a positive slope (a flat kind gets none, so the factor over
        every axis applies to it), and a ``collective_factor.<kind>@<axis>`` fit for each.
    """
    factors: dict[str, float] = {}
    fits: list[Fit] = []
    for kind in MODEL_KINDS:
        b, r2 = _slope(points[kind], launch)
        if b > 0 and slopes[kind] > 0:
            factors[kind] = b * link_bw / slopes[kind]
            fits.append(
                Fit(
                    f"collective_factor.{kind}@{axis}",
                    factors[kind],
                    r2,
                    len(points[kind]),
                    f"over {axis} (G={size}): V/t {1 / b / 1e9:.2f} GB/s measured vs "
                    f"{link_bw / slopes[kind] / 1e9:.2f} modelled",
                )
            )
    return factors, fits


def concurrent_terms(concurrent: Mapping[str, Any], dtypes: Sequence[str]) -> list[str]:
    """The terms whose figure measured with every device busy at once the spec carries (none on one device)."""
    if concurrent["devices"] <= 1:
        return []
    return [f"peak_flops.{dt}" for dt in dtypes if f"peak_flops.{dt}" in concurrent] + ["hbm_bandwidth"]


def prefer_concurrent(
    fits: Sequence[Fit], peaks: Mapping[str, float], hbm_bw: float, concurrent: Mapping[str, Any]
) -> tuple[list[Fit], dict[str, float], float]:
    """Swap the single-device peak FLOP/s and memory bandwidth for the figures with every device busy.

    Sharded programs run every emulated device at once on the same cores, so the spec carries the
    per-device figures measured that way (:func:`concurrent_terms`); every ``peak_flops`` and
    ``hbm_bandwidth`` fit then says so and keeps the single-device value in its note.

    Returns:
        The fits, the peak FLOP/s per dtype and the memory bandwidth the spec carries.
    """
    if concurrent["devices"] <= 1:
        return list(fits), dict(peaks), hbm_bw
    peaks = {dt: concurrent.get(f"peak_flops.{dt}", v) for dt, v in peaks.items()}
    hbm_bw = concurrent["hbm_bandwidth"]
    new_values = {f"peak_flops.{dt}": v for dt, v in peaks.items()} | {"hbm_bandwidth": hbm_bw}
    fits = [
        dataclasses.replace(
            f,
            value=new_values[f.term],
            r2=None,
            note=f"all {concurrent['devices']} devices at once (alone: {f.value:.3g})",
        )
        if f.term in new_values
        else f
        for f in fits
    ]
    return fits, peaks, hbm_bw


__all__ = [
    "Fit",
    "axis_factors",
    "best_matmul",
    "collective_factors",
    "concurrent_terms",
    "hbm_bandwidth",
    "hbm_bytes",
    "latency",
    "line",
    "model_slopes",
    "peak_flops",
    "prefer_concurrent",
]
